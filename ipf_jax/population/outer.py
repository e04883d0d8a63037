"""The outer loop's math (DESIGN.md §3b): when to synchronise, the anchor's outer optimizer, the pull.

  syncs:   every H steps (``every``); the Quadratic Synchronization Rule (``qsr``, Gu et al., ICLR 2024):
           after a sync at step t the next comes H_t = max(H_base, floor((alpha eta_peak / eta_t)^2)) steps later,
           eta_t the learning rate and eta_peak its peak (alpha relative to the peak, so that one value works for
           SGD's rates and AdamW's; the paper's absolute alpha is alpha eta_peak), rarer as it decays;
           SWAP (``swap``, Gupta et al., ICLR 2020): a sync after every step (data-parallel) until a fraction of
           the run, then none. The last step always syncs.
  anchor:  delta = A - theta_bar;  A, m <- outer_opt(delta, m, A)    (outer_lr = 1, no momentum: A = theta_bar;
           DiLoCo: outer_lr 0.7, Nesterov momentum 0.9)
  pull:    theta_i <- theta_i + gamma (A - theta_i)                  (gamma = 1: local SGD, every particle = A)

Pure functions of arrays and numbers: the SPMD wiring is ``spmd.outer_step``'s.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

SYNCS = ("every", "qsr", "swap")  # config.sync's outer-loop values ("step" is the per-step filter)


def qsr_period(lr: float, base: int, alpha: float) -> int:
  """``H = max(H_base, floor((alpha / lr)^2))`` (``lr`` relative to the peak); ``lr <= 0`` (the end of a cosine):
  no further sync (a huge H)."""
  if lr <= 0:
    return np.iinfo(np.int32).max
  return max(base, int(math.floor((alpha / lr) ** 2)))


def sync_steps(
  kind: str, total: int, every: int, lr_fn: Callable[[int], float], warmup: int, alpha: float, swap_fraction: float
) -> np.ndarray:
  """``[total]`` bool: whether step ``k`` (0-based) ends with a sync, a pure function of the run's numbers (a
  resumed run syncs where the uninterrupted one did). ``qsr`` keeps ``H_base`` during the warmup, where the
  learning rate starts from 0, and reads the rate relative to its value at the warmup's end (the peak)."""
  syncs = np.zeros(total, bool)
  if kind == "every":
    syncs[every - 1 :: every] = True
  elif kind == "qsr":
    k, peak = 0, float(lr_fn(min(warmup, max(total - 1, 0))))
    while k < total:
      k += every if k < warmup or peak <= 0 else qsr_period(float(lr_fn(k)) / peak, every, alpha)
      if k <= total:
        syncs[k - 1] = True
  elif kind == "swap":
    syncs[: int(round(swap_fraction * total))] = True
  else:
    raise ValueError(f"sync={kind!r}: one of {SYNCS}")
  if total:
    syncs[-1] = True
  return syncs


def outer_optimizer(lr: float, momentum: float) -> optax.GradientTransformation:
  """The anchor's optimizer on ``delta = A - theta_bar``: SGD, with Nesterov momentum when ``momentum > 0``
  (DiLoCo's outer optimizer; ``lr = 1, momentum = 0`` makes the anchor the weighted mean)."""
  return optax.sgd(lr, momentum=momentum or None, nesterov=momentum > 0)


def update_anchor(tx: optax.GradientTransformation, anchor, opt_state, mean):
  """``(A', opt_state')``: one outer step on ``delta = A - theta_bar``."""
  delta = jax.tree.map(jnp.subtract, anchor, mean)
  updates, opt_state = tx.update(delta, opt_state, anchor)
  return optax.apply_updates(anchor, updates), opt_state


def pull(tree, target, gamma):
  """``x_i <- x_i + gamma (target - x_i)`` for ``[L, ...]`` leaves and a ``target`` without the particle axis;
  integer leaves (counts) are left alone."""

  def one(x, t):
    if not jnp.issubdtype(x.dtype, jnp.inexact):
      return x
    return x + jnp.asarray(gamma, x.dtype) * (t[None].astype(x.dtype) - x)

  return jax.tree.map(one, tree, target)


def inexact(tree):
  """``tree`` with its non-float leaves (counts) as ``None``: what averaging and resetting touch."""
  return jax.tree.map(lambda x: x if jnp.issubdtype(x.dtype, jnp.inexact) else None, tree)


def keep_opt_state(opt_state, **_):
  """``sync_opt_state="keep"``: each particle's optimizer state as its local steps left it (post-local SGD,
  DiLoCo)."""
  return opt_state


def reset_opt_state(opt_state, *, init, params, gamma, **_):
  """``sync_opt_state="reset"``: the float leaves (momenta) as ``init(params)`` makes them for the pulled
  ``params``, where ``gamma > 0``; counts (a schedule's step) go on, so the learning rate does not restart."""
  fresh = init(params)
  return jax.tree.map(
    lambda new, old: jnp.where(gamma > 0, new, old) if jnp.issubdtype(old.dtype, jnp.inexact) else old,
    fresh,
    opt_state,
  )


def average_opt_state(opt_state, *, mean, gamma, **_):
  """``sync_opt_state="average"``: the float leaves pulled ``gamma`` of the way to their weighted mean ``mean``
  (``inexact``: counts are not averaged)."""
  return jax.tree.map(
    lambda m, x: x if m is None else x + jnp.asarray(gamma, x.dtype) * (m[None].astype(x.dtype) - x),
    mean,
    opt_state,
    is_leaf=lambda m: m is None,
  )


OPT_STATE_POLICIES = {"keep": keep_opt_state, "reset": reset_opt_state, "average": average_opt_state}

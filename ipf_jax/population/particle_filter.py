"""Importance weights, ESS, adaptive temperature, systematic resampling, slot assignment and jitter.

Pure functions. The weight math works on all ``P`` particles' values, which the
train step gathers once per step (``gather_all``); ``gather_all``, ``jitter``
and ``resample`` run inside ``shard_map`` on the local ``[L]`` slice of the
particle axis and communicate over the named mesh axis. ``resample`` moves the
particles with an exchange from ``exchange.py``.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ipf_jax.population.exchange import Exchange, count_rounds, exchange_all_to_all
from ipf_jax.population.streams import Stream, stream


def update_log_weights(log_w, loss, alive, temperature: float, forgetting: float):
  """``log w_i <- rho * log w_i - tau * loss_i``; ``-inf`` where not ``alive``.

  Args:
    log_w: ``[L]`` normalised log-weights from the previous step.
    loss: ``[L]`` per-particle training loss of this step.
    alive: ``[L]`` bool, False for a particle whose loss or gradient is not finite.
  Returns:
    ``[L]`` unnormalised log-weights.
  """
  new = forgetting * log_w - temperature * jnp.where(alive, loss, 0.0)
  return jnp.where(alive, new, -jnp.inf)


def logsumexp(log_w):
  """``log sum_i exp(log_w_i)`` over the last axis; ``-inf`` where all are ``-inf``."""
  m = jnp.max(log_w, axis=-1, keepdims=True)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)  # all -inf: avoid (-inf) - (-inf)
  return (m_safe + jnp.log(jnp.sum(jnp.exp(log_w - m_safe), axis=-1, keepdims=True)))[..., 0]


def normalize(log_w, islands: int = 1):
  """``log_w - logsumexp(log_w)`` over all ``P`` particles, so that ``sum_i w_i = 1``.

  With ``islands = G``: over each island (``G`` consecutive groups of ``P / G`` particles), then
  ``- log G_alive``: every island that has a finite weight holds the same share of the total, ``1 /
  G_alive``. An island whose particles are all ``-inf`` is returned unchanged (resampling refills it;
  if every particle is ``-inf`` the step sees ``num_alive == 0`` and skips the update).
  """
  rows = log_w.reshape(islands, -1)
  lse = logsumexp(rows)[:, None]
  alive = jnp.isfinite(lse)
  share = jnp.log(jnp.maximum(jnp.sum(alive), 1).astype(log_w.dtype))  # log 1 = 0 for one island
  return jnp.where(alive, rows - lse - share, rows).reshape(log_w.shape)


def island_ess(log_w, islands: int):
  """``[G]``: each island's own ESS, ``(sum w)^2 / sum w^2`` over its particles (NaN for an island with no
  finite weight)."""
  rows = log_w.reshape(islands, -1)
  return jnp.exp(2.0 * logsumexp(rows) - logsumexp(2.0 * rows))


def ess(log_w, islands: int = 1, dead: float = 0.0):
  """Effective sample size ``1 / sum_i w_i^2`` of normalised log-weights ``[P]``.

  With ``islands = G``: ``G`` times the smallest island's own ESS (``island_ess``; an island with no
  finite weight counts as ``dead``: ``0`` for the resampling decision, which must refill it), so that
  ``ess < threshold * P`` says that some island's ESS is below ``threshold * P / G``. ``G = 1``: the
  plain ESS.
  """
  if islands == 1:
    return jnp.exp(-logsumexp(2.0 * log_w))
  own = island_ess(log_w, islands)
  return islands * jnp.min(jnp.where(jnp.isfinite(own), own, dead))


def adaptive_temperature(
  previous,
  loss,
  alive,
  max_temperature: float,
  forgetting: float,
  target_ess: float,
  iterations: int = 30,
  islands: int = 1,
):
  """The largest ``tau`` in ``[0, max_temperature]`` with ``ess(normalize(rho prev - tau loss)) >= target_ess``
  (bisection over ``iterations`` halvings, replicated: all arguments are the ``[P]`` values of every
  particle); ``max_temperature`` when that already keeps the ESS, ``0`` when nothing does.

  Args:
    previous: ``[P]`` normalised log-weights before this step.
    loss: ``[P]`` this step's losses; ``alive``: ``[P]`` bool.
    target_ess: in particles (``ess_target * P``); ``islands``: as in ``ess``, over the islands that have a
      finite weight (an island with none has no ESS for ``tau`` to keep).
  """

  def ess_at(tau):  # an island without weight has no ESS to keep: it counts as infinite
    return ess(normalize(update_log_weights(previous, loss, alive, tau, forgetting), islands), islands, jnp.inf)

  def halve(_, bounds):
    lo, hi = bounds
    mid = 0.5 * (lo + hi)
    good = ess_at(mid) >= target_ess
    return jnp.where(good, mid, lo), jnp.where(good, hi, mid)

  zero = jnp.zeros((), loss.dtype)
  lo, _ = lax.fori_loop(0, iterations, halve, (zero, zero + max_temperature))
  return jnp.where(ess_at(zero + max_temperature) >= target_ess, zero + max_temperature, lo)


def gather_all(x, axis_name: str):
  """All particles' ``[P]`` values from each device's ``[L]`` slice, typed as
  identical on every device (``all_gather`` is typed device-varying, which
  ``lax.cond`` would reject): a scatter into zeros, then ``psum``."""
  num_local = x.shape[0]
  full = jnp.zeros((num_local * lax.axis_size(axis_name),) + x.shape[1:], x.dtype)
  full = lax.dynamic_update_slice_in_dim(full, x, lax.axis_index(axis_name) * num_local, axis=0)
  return lax.psum(full, axis_name)


def systematic_resample(u, log_w):
  """Systematic resampling of ``P`` particles with one shared uniform ``u``.

  ``a_n = min(searchsorted(c, (n + u) / P, side="right"), last)`` for
  ``n = 0..P-1``, with ``c = cumsum(w) / sum(w)`` and ``last`` the highest
  index with ``w > 0`` (so a culled particle is never an ancestor, even when
  rounding leaves ``c[-1]`` short of 1). The result is ascending and particle
  ``i`` gets ``floor(P w_i)`` or ``floor(P w_i) + 1`` copies.

  Args:
    u: scalar in ``[0, 1)``.
    log_w: ``[P]`` log-weights of all particles (normalised or not).
  Returns:
    ``[P]`` int32 ancestors.
  """
  num = log_w.shape[0]
  w = jnp.exp(log_w - jnp.max(log_w))
  c = jnp.cumsum(w)
  c = c / c[-1]
  positions = (jnp.arange(num, dtype=c.dtype) + u) / num
  idx = jnp.searchsorted(c, positions, side="right").astype(jnp.int32)
  last = num - 1 - jnp.argmax(w[::-1] > 0).astype(jnp.int32)
  return jnp.minimum(idx, last)


def assign_slots(ancestors):
  """Slot assignment that keeps survivors in place.

  A particle with at least one offspring keeps one copy in its own slot; the
  freed slots (no offspring), in ascending order, receive the extra copies in
  ascending ancestor order.

  Args:
    ancestors: ``[P]`` ascending ancestor indices (from ``systematic_resample``).
  Returns:
    ``[P]`` int32 ``src`` with ``new_particle[n] = old_particle[src[n]]``.
  """
  num = ancestors.shape[0]
  ancestors = ancestors.astype(jnp.int32)
  counts = jnp.bincount(ancestors, length=num)
  first = jnp.concatenate([jnp.ones((1,), bool), ancestors[1:] != ancestors[:-1]])
  extras = ancestors[jnp.argsort(first, stable=True)]  # repeated copies first, in order
  freed = counts == 0
  rank = jnp.cumsum(freed) - 1
  return jnp.where(freed, extras[jnp.clip(rank, 0, num - 1)], jnp.arange(num, dtype=jnp.int32))


def sources(u, log_w, islands: int = 1):
  """``[P]`` int32 ``src`` of a resampling, ``new_particle[n] = old_particle[src[n]]``: each island (``islands``
  consecutive groups of ``n = P / islands``; one island: the whole population) is resampled on its own
  (``systematic_resample`` of its weights with the same ``u``, then ``assign_slots``), so a copy never leaves
  its island and survivors keep their slots. An island with no finite weight takes the resampled particles
  of the next island (cyclically) that has one.
  """
  num = log_w.shape[0]
  n = num // islands
  rows = log_w.reshape(islands, n)
  own = jax.vmap(lambda row: assign_slots(systematic_resample(u, row)))(rows)
  own = own + n * jnp.arange(islands, dtype=jnp.int32)[:, None]
  alive = jnp.isfinite(rows).any(axis=1)
  order = (jnp.arange(islands)[:, None] + jnp.arange(islands)[None, :]) % islands  # row g: g, g + 1, ...
  donor = jnp.take_along_axis(order, jnp.argmax(alive[order], axis=1)[:, None], axis=1)[:, 0]
  return own[donor].reshape(num)


def place_ascending(src, num_local: int, islands: int = 1):
  """``resample_placement = "ascending"``: ``src`` as ``sources`` made it (freed slots take the copies in
  ancestor order), the same on any mesh."""
  del num_local, islands
  return src


def place_local(src, num_local: int, islands: int = 1):
  """``resample_placement = "local"``: ``src`` (``[P]`` int, from ``sources``) as ``[P]`` int32 with its copies
  moved between the slots they fill so that ``exchange_rounds`` runs fewer rounds across devices (DESIGN.md
  §3.5). Survivors (``src[n] == n``) stay, and the copies of each island (``islands`` consecutive groups of
  slots) stay in it, so every particle keeps its number of copies; only which freed slot takes which copy
  changes. Greedy, deterministic, the same on every device: while a slot is free, take the round ``(k, j)``
  (device ``d`` sends to ``d + k``, into slot ``j``; ``k = 0`` a copy within a device) that fills the most
  free slots, a round within a device (``k = 0``) before any other, ties to the smallest ``k`` then ``j``;
  each slot it fills takes, of the copies still waiting on its source device in its island, the one ``src``
  put in the lowest slot. The greedy is not optimal: where it would run more rounds across devices than
  ``src`` (or as many and more in all; about 1 draw in 200), ``src`` is kept. ``num_local``: ``L``, the slots
  per device.

  The run then depends on the mesh (``Dp = P / L`` and ``L``), where ``sources`` alone does not: each
  resampling is as unbiased as before (a particle's expected number of copies is ``P w``), but a copy's slot
  sets which shard of the batch it trains on, its jitter's draw, and its place in the next resampling's
  cumulative sum."""
  num = src.shape[0]
  src = src.astype(jnp.int32)
  if num_local == num:  # one device: every copy is local, and the rule is the ascending one
    return src
  axis_size, slots = num // num_local, jnp.arange(num, dtype=jnp.int32)
  moved = src != slots
  island = slots // (num // islands)
  src_dev = src // num_local  # the device each copy waits on
  grid_island = island.reshape(axis_size, num_local)
  ks, ts = jnp.arange(axis_size)[:, None], jnp.arange(axis_size)[None, :]
  sender = (ts - ks) % axis_size  # [k, t]: the device t receives from in a round of shift k

  def round_(carry):
    waiting, free, out = carry
    first = jnp.full((axis_size, islands), num, jnp.int32).at[src_dev, island].min(jnp.where(waiting, slots, num))
    offer = first[sender[:, :, None], grid_island[None]]  # [k, t, j]: the copy slot j of t would take
    fills = free.reshape(axis_size, num_local)[None] & (offer < num)
    count = fills.sum(axis=1)  # [k, j]
    count = count.at[0].add(jnp.where(count[0] > 0, num, 0))  # within a device first
    k, j = jnp.divmod(jnp.argmax(count.ravel()).astype(jnp.int32), num_local)
    take = fills[k, :, j]  # [t]
    copy = jnp.where(take, offer[k, :, j], num)  # [t], num where t's slot j takes nothing
    dest = jnp.where(take, jnp.arange(axis_size) * num_local + j, num)
    out = out.at[dest].set(src[jnp.minimum(copy, num - 1)], mode="drop")
    return waiting.at[copy].set(False, mode="drop"), free.at[dest].set(False, mode="drop"), out

  _, _, out = lax.while_loop(lambda c: jnp.any(c[1]), round_, (moved, moved, slots))
  (across, within), (was_across, was_within) = count_rounds(out, num_local), count_rounds(src, num_local)
  better = (across < was_across) | ((across == was_across) & (across + within <= was_across + was_within))
  return jnp.where(better, out, src)


# resample_placement: which freed slot takes which copy, ``place(src, num_local, islands) -> src``.
PLACEMENTS = {"ascending": place_ascending, "local": place_local}


def jitter(params, src, key, sigma: float, axis_name: str, shards: Optional[tuple] = None):
  """``theta += sigma * eps`` on the local slots that received a copy (``src[n] != n``).

  Slot ``n``'s noise is one float32 draw ``normal(fold_in(key, n), (its number of weights,))``, cut into the
  leaves in ``jax.tree.flatten`` order: the same on any mesh. One draw, not one per leaf: a per-leaf draw
  compiles one RNG per leaf inside the resampling branch (+6 s per compile of the digits step, measured).
  Slots are drawn one at a time: the temporaries (the random bits, the normals, their pieces) are a few
  particles' weights in float32 (5x, compiled alone for the digits CNN), whatever ``L`` and the mesh.
  Runs inside ``shard_map``; ``params`` leaves are the local ``[L, ...]`` slices. ``shards`` = ``(dims,
  axis)`` when some leaves are shards of a particle sharded over ``axis`` (``fsdp.shards``: each leaf's sharded
  dimension of its ``[P, ...]`` leaf, or -1): the whole particle's noise is drawn and each device keeps its
  shard, so the copies are the same as with whole particles.
  """
  leaves, treedef = jax.tree.flatten(params)
  num_local = leaves[0].shape[0]
  first = lax.axis_index(axis_name) * num_local
  slots = first + jnp.arange(num_local)
  copied = lax.dynamic_slice_in_dim(src, first, num_local) != slots
  dims, shard_axis = shards or ((-1,) * len(leaves), None)
  shapes = [_whole_shape(x.shape[1:], d, shard_axis) for x, d in zip(leaves, dims)]
  sizes = [math.prod(shape) for shape in shapes]

  def add_noise(j, out):
    eps = jnp.split(jax.random.normal(jax.random.fold_in(key, slots[j]), (sum(sizes),)), np.cumsum(sizes)[:-1])
    eps = [_shard(e.reshape(shape), d, shard_axis) for e, shape, d in zip(eps, shapes, dims)]
    return [
      lax.dynamic_update_index_in_dim(
        x, lax.dynamic_index_in_dim(x, j, keepdims=False) + (sigma * e).astype(x.dtype), j, 0
      )
      for x, e in zip(out, eps)
    ]

  # A survivor's slot draws nothing; one loop body (not one cond per slot) keeps the compile time flat in L.
  leaves = lax.fori_loop(
    0, num_local, lambda j, out: lax.cond(copied[j], add_noise, lambda j, out: out, j, out), leaves
  )
  return jax.tree.unflatten(treedef, leaves)


def _whole_shape(shape: tuple, dim: int, axis: Optional[str]) -> tuple:
  """A particle's leaf shape from its shard's (``dim``: the shard's dimension of the ``[P, ...]`` leaf, -1 whole)."""
  if dim < 0:
    return tuple(shape)
  return tuple(n * lax.axis_size(axis) if i == dim - 1 else n for i, n in enumerate(shape))


def _shard(whole, dim: int, axis: Optional[str]):
  """This device's shard of a particle's whole leaf (``_whole_shape``'s inverse)."""
  if dim < 0:
    return whole
  size = whole.shape[dim - 1] // lax.axis_size(axis)
  return lax.dynamic_slice_in_dim(whole, lax.axis_index(axis) * size, size, axis=dim - 1)


def resample(
  key,
  particle,
  log_w,
  all_log_w,
  axis_size: int,
  sigma: float = 0.0,
  axis_name: str = "particle",
  exchange: Exchange = exchange_all_to_all,
  islands: int = 1,
  shards: Optional[tuple] = None,
  place: Callable = place_ascending,
):
  """Systematic resampling of the whole population (or of each island), survivors in place (DESIGN.md §3.5).

  ``u`` from ``Stream.RESAMPLE``; slot ``n`` takes particle ``src[n]``, ``src = place(sources(u, all_log_w,
  islands), L, islands)`` (``systematic_resample`` then ``assign_slots``, per island, then the placement;
  survivors keep their slots, as ``exchange_rounds`` requires), moved by ``exchange``;
  copies get ``jitter`` from ``Stream.JITTER`` when ``sigma`` (a float, or a traced scalar) is not
  ``0``; weights reset to ``-log P``.

  Args:
    particle: tuple ``(params, ...)`` of local ``[L, ...]`` trees that move together.
    log_w: ``[L]`` local log-weights; ``all_log_w``: ``[P]`` all of them (replicated).
    shards: ``jitter``'s, when the parameters are shards of sharded particles (``fsdp.shards``).
    place: ``PLACEMENTS[resample_placement]``, ``place(src, L, islands) -> src``: which freed slot takes which
      copy.
  Returns:
    ``(particle, uniform log-weights [L], src [P])``.
  """
  u = jax.random.uniform(stream(key, Stream.RESAMPLE))
  src = sources(u, all_log_w, islands)
  src = place(src, all_log_w.shape[0] // axis_size, islands)
  params, *rest = exchange(particle, src, axis_name, axis_size)
  if not isinstance(sigma, (int, float)) or sigma:  # a traced sigma (jitter_lr) always applies
    params = jitter(params, src, stream(key, Stream.JITTER), sigma, axis_name, shards)
  return (params, *rest), jnp.full_like(log_w, -jnp.log(all_log_w.shape[0])), src

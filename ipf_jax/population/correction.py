"""Weighted global correction (DESIGN.md §3.3): psums of weighted particle trees.

Inside ``shard_map`` each leaf is the local block ``[L, ...]`` and ``weights``
the local ``[L]`` normalised weights; the sum over all particles is a local sum
followed by ``psum`` over the particle axis.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax


def weighted_sum(tree, weights, axis_name: Optional[str] = None):
  """``sum_i w_i x_i`` over all particles, for every leaf.

  A particle with ``w_i = 0`` contributes exactly zero even if its leaves are
  NaN (a culled particle must not poison the sum), hence ``where`` not ``*``.
  Returns leaves without the particle axis, identical on every device.
  """

  def one(x):
    w = weights.reshape(weights.shape + (1,) * (x.ndim - 1)).astype(x.dtype)
    s = jnp.sum(jnp.where(w > 0, w * x, jnp.zeros_like(x)), axis=0)
    return s if axis_name is None else lax.psum(s, axis_name)

  return jax.tree.map(one, tree)


def mix(grads, consensus, strength: float):
  """``d_i = (1 - lambda) g_i + lambda * g_bar``."""
  return jax.tree.map(lambda g, c: (1.0 - strength) * g + strength * c[None].astype(g.dtype), grads, consensus)


def correct(grads, weights, strength: float, axis_name: Optional[str] = None):
  """``d_i = (1 - lambda) g_i + lambda * sum_j w_j g_j`` (DESIGN.md §3.3)."""
  if strength == 0.0:
    return grads
  return mix(grads, weighted_sum(grads, weights, axis_name), strength)

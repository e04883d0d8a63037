"""How a device runs its ``L`` local particles: one function written for one particle, looped."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from ipf_jax.spmd.mesh import DATA, PARTICLE


def per_particle(mask, x):
  """Broadcast an ``[L]`` mask against an ``[L, ...]`` leaf."""
  return mask.reshape(mask.shape + (1,) * (x.ndim - 1))


def over_particles(fn: Callable, loop: str, in_axes: tuple) -> Callable:
  """``fn`` (written for one particle) over the local particles: ``jax.vmap``,
  ``lax.map`` (a loop XLA keeps rolled) or a Python loop unrolled at trace time.

  ``in_axes`` as for ``vmap``: 0 for per-particle arguments, None for shared
  ones. A vmapped convolution becomes a grouped convolution, which some
  backends run slower than separate ones; ``particle_loop`` picks.
  """
  if loop == "vmap":
    return jax.vmap(fn, in_axes=in_axes)

  def run(*args):
    per = [a for a, ax in zip(args, in_axes) if ax == 0]

    def one(sliced):
      it = iter(sliced)
      return fn(*[next(it) if ax == 0 else a for a, ax in zip(args, in_axes)])

    if loop == "map":
      return lax.map(one, per)
    num = jax.tree.leaves(per)[0].shape[0]
    outs = [one(jax.tree.map(lambda x, i=i: x[i], per)) for i in range(num)]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)

  return run


def slot_keys(key, num_local: int):
  """``[L]`` keys, one per particle, the same on each of its data shards: ``fold_in(key, slot)``."""
  slots = lax.axis_index(PARTICLE) * num_local + jnp.arange(num_local)
  return jax.vmap(lambda s: jax.random.fold_in(key, s))(slots)


def particle_keys(key, num_local: int):
  """``[L]`` keys, one per particle and data shard: ``fold_in(fold_in(key, slot), data index)``. A
  particle's key depends on its slot and the step only, so a resumed run draws the same numbers."""
  return jax.vmap(lambda k: jax.random.fold_in(k, lax.axis_index(DATA)))(slot_keys(key, num_local))

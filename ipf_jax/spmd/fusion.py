"""The fused model (DESIGN.md §6): weighted parameters, particle distances, BatchNorm re-estimation, export.

``theta_bar = sum_i w_i theta_i`` and ``beta_bar = sum_i w_i beta_i`` are
weighted ``psum``s over ``"particle"``. The averaged network's activations need
not match ``beta_bar``; ``make_fused_bn_fn`` re-estimates its BatchNorm
statistics on training batches (as SWA does). The export is plain Flax:

  model, variables = ipf_jax.spmd.fusion.load_fused("WORKDIR/fused_model")
  logits = model.apply(variables, images, train=False)

``WORKDIR/fused_model.msgpack`` holds ``{"params", "batch_stats"}`` (flax
msgpack); ``fused_model.json`` the model-zoo fields that rebuild the module
(``None`` for a model the user brought: pass it to ``load_fused``).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from ipf_jax.population import correction
from ipf_jax.population import particle_filter as pf
from ipf_jax.population.streams import Stream, stream
from ipf_jax.spmd import fsdp, sharing
from ipf_jax.spmd.layout import TRAIN_BATCH_SPEC
from ipf_jax.spmd.mesh import PARTICLE
from ipf_jax.spmd.particles import over_particles
from ipf_jax.spmd.state import ParticleState, shard_map_on_state


def fused(state: ParticleState):
  """``(sum_i w_i theta_i, sum_i w_i beta_i)`` inside ``shard_map`` (per-particle parameters only); the outer
  loop's fused parameters are its anchor (DESIGN.md §3b)."""
  w = jnp.exp(state.log_weights)
  if state.anchor is not None:  # weights may lack a particle culled since the last sync: renormalised
    w = w / lax.psum(jnp.sum(w), PARTICLE)
  params = correction.weighted_sum(state.params, w, PARTICLE) if state.anchor is None else state.anchor
  return params, correction.weighted_sum(state.batch_stats, w, PARTICLE)


def make_fuse_fn(mesh: jax.sharding.Mesh) -> Callable:
  """``fuse(state) -> (variables, distances)``, both replicated.

  ``variables`` = ``{"params": theta_bar (with the shared ones), "batch_stats": beta_bar}``, ready for
  a plain ``model.apply``; ``distances`` ``[P]`` = ``||theta_i - theta_bar||`` (particle diversity).
  ``config.fsdp``: the weighted sum is taken shard by shard, then gathered.
  """

  def local(dims, state: ParticleState):
    params, stats = fused(state)
    whole = fsdp.gather(params, dims, invariant=True)
    variables = {"params": sharing.merge(whole, state.shared_params), "batch_stats": stats}
    return variables, distances(state, params, dims)

  return jax.jit(shard_map_on_state(local, mesh, (), lambda _: (P(), P())))


def make_diversity_fn(mesh: jax.sharding.Mesh) -> Callable:
  """``diversity(state) -> distances``, ``make_fuse_fn``'s second output alone (what a log line needs): the
  fused parameters are summed on the way, never returned, so no replicated copy of the model is kept."""

  def local(dims, state: ParticleState):
    return distances(state, fused(state)[0], dims)

  return jax.jit(shard_map_on_state(local, mesh, (), lambda _: P()))


def distances(state: ParticleState, fused_params, dims=None):
  """Inside ``shard_map``: ``[P]`` (replicated) ``||theta_i - theta_bar||`` over the particles' own (not shared)
  parameters, gathered (``config.fsdp``: the shards' squares summed over ``"data"``)."""
  sq = [
    jnp.sum(jnp.square(x - f[None]).reshape(x.shape[0], -1), axis=1)
    for x, f in zip(jax.tree.leaves(state.params), jax.tree.leaves(fused_params))
  ]
  sq = fsdp.sum_over_shards(sq, dims)
  return pf.gather_all(jnp.sqrt(sq), PARTICLE)


def make_fused_bn_fn(task, mesh: jax.sharding.Mesh, particle_loop: str = "vmap") -> Callable:
  """``fused_bn(state, batch) -> batch_stats``: the fused model's BatchNorm statistics on one train batch.

  The fused parameters run in train mode on each particle's shard of ``batch`` (laid out as for the
  train step; statistics synchronised over ``"data"`` as in training); the per-shard means and
  variances are averaged over all shards. Returned replicated.

  Any module's BatchNorm momentum ``m`` drops out: from running statistics started at 0 and at 1,
  ``a = (1 - m) s`` and ``b = m + (1 - m) s``, so ``s = a / (1 - (b - a))``.
  """

  def local(dims, state: ParticleState, batch):
    params = fused(state)[0]  # stats are replaced
    params = fsdp.gather(params, dims, invariant=True)
    params = sharing.merge(params, state.shared_params)
    key = stream(state.rng, Stream.FUSED_BN) if task.rngs else None

    def one(shard):
      def stats(start):
        start = jax.tree.map(lambda x: jnp.full_like(x[0], start), state.batch_stats)
        return task.apply({"params": params, "batch_stats": start}, shard, train=True, key=key)[1]

      a, b = stats(0.0), stats(1.0)
      return jax.tree.map(lambda a, b: a / (1.0 - (b - a)), a, b)

    stats = over_particles(one, particle_loop, (0,))(batch)
    return lax.pmean(jax.tree.map(lambda x: jnp.mean(x, axis=0), stats), PARTICLE)

  return jax.jit(shard_map_on_state(local, mesh, (TRAIN_BATCH_SPEC,), lambda _: P()))


def reestimate_bn(
  fused_bn_fn: Callable, state, batches, wait: Callable = lambda x: x, interrupted: Callable[[], bool] = lambda: False
):
  """The mean of ``fused_bn_fn(state, b)`` over the device batches ``batches`` (``None`` if empty)."""
  total, n = None, 0
  for batch in batches:
    if interrupted():
      raise InterruptedError("stop requested")
    stats = wait(fused_bn_fn(state, batch))
    total = stats if total is None else jax.tree.map(jnp.add, total, stats)
    n += 1
  return None if total is None else jax.tree.map(lambda x: x / n, total)

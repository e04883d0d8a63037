"""Evaluation: the eval step (every particle, both ensembles, the fused model), the loop over an eval set
(every example exactly once: padded last batch, masked) and the final table."""

from __future__ import annotations

import functools
from typing import Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from ipf_jax.data.errors import DataError
from ipf_jax.population import correction
from ipf_jax.population import particle_filter as pf
from ipf_jax.spmd import fsdp, fusion, layout, sharing
from ipf_jax.spmd.mesh import DATA, PARTICLE
from ipf_jax.spmd.particles import over_particles
from ipf_jax.spmd.state import ParticleState, shard_map_on_state
from ipf_jax.spmd.task import Task


def make_eval_step(task: Task, mesh: jax.sharding.Mesh, particle_loop: str = "vmap") -> Callable:
  """``eval_step(state, batch, fused_bn=None) -> sums`` for every particle, the ensembles and the fused model.

  ``batch`` is a dict of ``[N, ...]`` arrays with a ``mask`` (1 = real example), split over every
  device (``layout.EVAL_BATCH_SPEC``); the step gathers each device's part over ``"particle"``, so
  that every particle sees every example and no host has to read them all. Returns ``task.score``
  sums, replicated: ``particles`` with a leading ``[P]`` axis, ``ensemble`` (the mixture
  ``sum_i w_i predictive_i``), ``ensemble_uniform`` (equal weights over finite particles), ``fused``
  (``f(sum_i w_i theta_i)`` with ``sum_i w_i beta_i``) and, with ``fused_bn`` (replicated BatchNorm statistics from
  ``fusion.make_fused_bn_fn``), ``fused_bn``; plus ``weights`` ``[P]``.
  """

  def predict(params, shared, batch_stats, batch, dims=None):
    params = fsdp.gather(params, dims, invariant=True)  # config.fsdp: the whole particle from its shards
    outputs = task.apply({"params": sharing.merge(params, shared), "batch_stats": batch_stats}, batch, train=False)
    return task.predictive(outputs, batch)

  def local_eval(dims, state: ParticleState, batch, fused_bn):
    mine = batch  # this device's part: the fused model (one model, replicated) is evaluated on it alone
    batch = jax.tree.map(lambda x: pf.gather_all(x, PARTICLE), batch)  # my data group's examples, every device
    mask = batch["mask"]
    shared = state.shared_params
    pred = over_particles(functools.partial(predict, dims=dims), particle_loop, (0, None, 0, None))(
      state.params, shared, state.batch_stats, batch
    )
    w = jnp.exp(state.log_weights)
    alive = (w > 0).astype(jnp.float32)
    per_particle = jax.vmap(task.score, in_axes=(0, None, None))(pred, batch, mask)
    ensemble = mixture(pred, w, PARTICLE)
    uniform = mixture(pred, alive / lax.psum(alive.sum(), PARTICLE), PARTICLE)
    params, stats = fusion.fused(state)
    sums = {
      "particles": jax.tree.map(lambda x: pf.gather_all(x, PARTICLE), per_particle),
      "ensemble": task.score(ensemble, batch, mask),
      "ensemble_uniform": task.score(uniform, batch, mask),
    }
    fused_sums = {"fused": task.score(predict(params, shared, stats, mine, dims), mine, mine["mask"])}
    if fused_bn is not None:
      fused_sums["fused_bn"] = task.score(predict(params, shared, fused_bn, mine, dims), mine, mine["mask"])
    if task.diversity is not None:
      sums["diversity"] = task.diversity(pred, alive, mask, lambda x: lax.psum(x, PARTICLE))
    return {**lax.psum(sums, DATA), **lax.psum(fused_sums, (PARTICLE, DATA)), "weights": pf.gather_all(w, PARTICLE)}

  sharded = jax.jit(shard_map_on_state(local_eval, mesh, (layout.EVAL_BATCH_SPEC, P()), lambda _: P()))
  return lambda state, batch, fused_bn=None: sharded(state, batch, fused_bn)


def mixture(pred, weights, axis_name: str):
  """The weighted mixture of all particles' predictive quantities (``[L, b, ...]`` leaves, ``[L]`` weights).

  A leaf is mixed linearly, ``sum_i w_i x_i``, unless its key starts with ``log_``: then it holds
  log-values (a log-density) and mixes as ``log sum_i w_i exp(x_i)``, computed stably (``pmax`` and
  ``psum`` over ``axis_name``), so that a density too small for float32 still counts. A particle with
  ``w_i = 0`` contributes nothing, even if its values are NaN.
  """

  def mix(path, x):
    if not (path and str(getattr(path[-1], "key", "")).startswith("log_")):
      return correction.weighted_sum(x, weights, axis_name)
    w = weights.reshape(weights.shape + (1,) * (x.ndim - 1))
    live = jnp.where(w > 0, x, -jnp.inf)
    m = lax.pmax(jnp.max(live, axis=0), axis_name)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    total = lax.psum(jnp.sum(jnp.where(w > 0, w * jnp.exp(live - m), 0.0), axis=0), axis_name)
    return m + jnp.log(total)

  return jax.tree_util.tree_map_with_path(mix, pred)


def padded(batches: Iterable[dict], batch_size: int):
  """Batches of exactly ``batch_size`` with a ``mask``: a batch that has none gets ones, a short one is
  zero-padded (mask 0), a long one split. Every example counts once."""
  for batch in batches:
    n = len(next(iter(batch.values())))
    batch = dict(batch)
    batch.setdefault("mask", np.ones(n, np.float32))
    for start in range(0, n, batch_size):
      part = {k: v[start : start + batch_size] for k, v in batch.items()}
      pad = batch_size - (min(n, start + batch_size) - start)
      if pad:
        part = {k: np.concatenate([v, np.zeros((pad,) + v.shape[1:], v.dtype)]) for k, v in part.items()}
      yield part


def _agreed(batches: Iterable[dict], across_processes: bool) -> Iterator[dict]:
  """``batches``, continued with all-masked copies of the last one until every process's have ended:
  each eval step runs on every process, and the parts of the eval set may differ by a batch."""
  if not across_processes:
    yield from batches
    return
  from jax.experimental import multihost_utils

  stream, last = iter(batches), None
  while True:
    batch = next(stream, None)
    has, can = (
      multihost_utils.process_allgather(np.array([batch is not None, batch is not None or last is not None], np.int32))
      .reshape(-1, 2)
      .T
    )
    if not has.any():
      return
    if not can.all():
      empty = [int(i) for i in np.flatnonzero(can == 0)]
      raise DataError(
        f"the evaluation parts of processes {empty} are empty while others are not: each process "
        f"reads its own part of the eval set, so it needs at least as many examples as processes"
      )
    if batch is None:
      batch = dict(last, mask=np.zeros_like(last["mask"]))
    last = batch
    yield batch


def evaluate(
  task: Task,
  eval_step,
  state,
  batches: Iterable[dict],
  batch_size: int,
  mesh,
  fused_bn=None,
  wait: Callable = lambda x: x,
  interrupted: Callable[[], bool] = lambda: False,
  process_local: bool = False,
) -> dict:
  """``task.finalize``d metrics of every row over ``batches`` (see ``padded``); ``weights`` ``[P]``.

  ``batches`` is the whole eval set, or (``process_local``) this process's part of it, every example in
  exactly one process's part; batches of ``layout.eval_batch_sizes(batch_size, mesh)`` (global, per
  process). ``interrupted()`` is asked between batches (raises ``InterruptedError``).
  """
  size, local = layout.eval_batch_sizes(batch_size, mesh)
  total = weights = None
  for batch in _agreed(padded(batches, local if process_local else size), process_local and jax.process_count() > 1):
    if interrupted():
      raise InterruptedError("stop requested")
    sums = wait(eval_step(state, layout.put_eval_batch(batch, mesh, process_local), fused_bn))
    weights = sums.pop("weights")
    total = sums if total is None else jax.tree.map(lambda a, b: a + b, total, sums)
  if total is None:
    raise DataError("the evaluation set is empty: eval_batches gave no batch")
  results = {
    k: (task.finalize_diversity if k == "diversity" else task.finalize)(v) for k, v in jax.device_get(total).items()
  }
  results["weights"] = np.asarray(jax.device_get(weights))
  return results

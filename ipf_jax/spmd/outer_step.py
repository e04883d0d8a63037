"""The outer loop's train step (DESIGN.md §3b): local steps between syncs, the filter and the anchor at syncs.

  every step k, each particle on its own shard (no collective over "particle"):
    1. local:   l_i, g_i = value_and_grad(loss)(theta_i; x_i);  theta_i, mu_i <- opt(g_i, mu_i, theta_i)
                (a particle whose loss or gradient is not finite keeps its state and gets log w_i = -inf)
  after the update of a sync step (``population.outer.sync_steps``):
    2. weigh:   s_i = particle i's loss, before the update, on the same examples (the first ``sync_examples``
                of every particle's part of the batch, gathered over "particle");
                log w_i <- rho log w_i - tau s_i, normalised (tau: ``sync_temperature``; ``ess_target``: adapted)
    3. anchor:  theta_bar = sum_i w_i theta_i (one weighted psum);  A, m <- outer_opt(A - theta_bar, m, A)
    4. resample if ESS < threshold P or a particle died (the exchange of the per-step filter; weights uniform)
    5. pull:    theta_i <- theta_i + gamma (A - theta_i),  beta_i <- beta_i + gamma (beta_bar - beta_i),
                mu_i kept, reset or pulled to the weighted mean (``sync_opt_state``)
  The last step syncs with gamma = 0: the anchor (the fused model) is current, the particles (the ensemble)
  keep what their last local phase made of them.

The local step and the sync step are two programs compiled once each; the host picks one per step
(``OuterTrainStep.at``). Built from ``step``'s phases (``gradients``, ``resample_phase``), not as more branches
of it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from ipf_jax.population import correction
from ipf_jax.population import exchange as exchange_lib
from ipf_jax.population import outer as outer_lib
from ipf_jax.population import particle_filter as pf
from ipf_jax.population.streams import Stream, stream
from ipf_jax.spmd import fusion
from ipf_jax.spmd import step as step_lib
from ipf_jax.spmd.layout import TRAIN_BATCH_SPEC
from ipf_jax.spmd.mesh import PARTICLE
from ipf_jax.spmd.particles import particle_keys, per_particle
from ipf_jax.spmd.spec import OuterSpec, ParticleSpec
from ipf_jax.spmd.state import ParticleState, shard_map_on_state
from ipf_jax.spmd.task import Task

PER_PARTICLE = ("loss", "alive", "grad_norm", "log_weights")  # [P] metrics, sharded over "particle"


@dataclasses.dataclass(frozen=True)
class OuterParts:
  """What the outer loop's programs are built from."""

  task: Task
  tx: optax.GradientTransformation
  spec: ParticleSpec
  outer: OuterSpec
  outer_tx: optax.GradientTransformation
  dp: int
  lr_fn: Optional[optax.Schedule]
  exchange: exchange_lib.Exchange


def local_update(c: OuterParts, state: ParticleState, batch, key, dims=None):
  """Phase 1 on this device's particles: ``(state, gradients)``; nothing crosses ``"particle"``."""
  g = step_lib.gradients(c.task, dataclasses.replace(c.spec, weigh_on="own"), state, batch, key, dims)
  updates, opt_state = jax.vmap(c.tx.update)(g.grads, state.opt_state, state.params)
  keep = lambda new, old: jnp.where(per_particle(g.alive, new), new, old)
  new = state.replace(
    params=jax.tree.map(keep, optax.apply_updates(state.params, updates), state.params),
    batch_stats=jax.tree.map(keep, g.batch_stats, state.batch_stats),
    opt_state=jax.tree.map(keep, opt_state, state.opt_state),
    log_weights=jnp.where(g.alive, state.log_weights, -jnp.inf),
    step=state.step + 1,
  )
  return new, g


def local_metrics(c: OuterParts, state: ParticleState, new: ParticleState, g) -> dict:
  """The step's metrics without a collective: ``PER_PARTICLE`` ones are this device's ``[L]`` block of ``[P]``."""
  metrics = {
    "loss": g.loss,
    "alive": g.alive.astype(jnp.int32),
    "grad_norm": jax.vmap(optax.tree.norm)(g.grads),
    "log_weights": new.log_weights,
    "resampled": jnp.zeros((), bool),
    "synced": jnp.zeros((), bool),
  }
  if c.lr_fn is not None:
    metrics["lr"] = jnp.asarray(c.lr_fn(step_lib.updates_done(state)), jnp.float32)
  return metrics


def sync_weights(c: OuterParts, state: ParticleState, score, alive):
  """Phase 2: ``(all_log_w [P], tau, score [P])`` from each particle's common-examples ``score`` ``[L]``."""
  spec = c.spec
  table = pf.gather_all(jnp.stack([score, alive.astype(score.dtype), state.log_weights], axis=1), PARTICLE)
  scores, alive_all, previous = table[:, 0], table[:, 1] > 0, table[:, 2]
  tau = jnp.asarray(c.outer.sync_temperature, score.dtype)
  if spec.ess_target:
    tau = pf.adaptive_temperature(
      previous, scores, alive_all, c.outer.sync_temperature, spec.forgetting, spec.ess_target * spec.num_particles,
      islands=spec.islands,
    )  # fmt: skip
  raw = pf.update_log_weights(previous, scores, alive_all, tau, spec.forgetting)
  return pf.normalize(raw, spec.islands), tau, scores


def synchronise(c: OuterParts, state: ParticleState, all_log_w, key, gamma, dims=None):
  """Phases 3-5 on the updated population: ``(state, resampled, src [P])``."""
  spec, num_local = c.spec, state.log_weights.shape[0]
  log_w = step_lib.local_slice(all_log_w, num_local)
  w = jnp.exp(log_w)
  mean = correction.weighted_sum(state.params, w, PARTICLE)
  stats = correction.weighted_sum(state.batch_stats, w, PARTICLE)
  averaged = c.outer.sync_opt_state == "average"
  opt_mean = correction.weighted_sum(outer_lib.inexact(state.opt_state), w, PARTICLE) if averaged else None
  anchor, outer_state = outer_lib.update_anchor(c.outer_tx, state.anchor, state.outer_opt_state, mean)
  num_alive = jnp.sum(jnp.isfinite(all_log_w))
  decide = pf.ess(all_log_w, spec.islands) < spec.ess_threshold * spec.num_particles
  # The last sync (gamma = 0) replaces only the dead: the ensemble is what the last local phase made.
  decide = ((decide & (gamma > 0)) | (num_alive < spec.num_particles)) & (num_alive > 0)
  sigma = step_lib.jitter_sigma(spec, c.lr_fn, state.step - 1)
  state = state.replace(log_weights=log_w)
  state, src = step_lib.resample_phase(spec, c.dp, state, key, all_log_w, decide, sigma, c.exchange, dims)
  params = outer_lib.pull(state.params, anchor, gamma)
  opt_state = outer_lib.OPT_STATE_POLICIES[c.outer.sync_opt_state](
    state.opt_state, init=jax.vmap(c.tx.init), params=params, mean=opt_mean, gamma=gamma
  )
  # The weights describe the particles before the pull: a particle moved the fraction gamma to the anchor keeps
  # w^(1 - gamma) of its weight (gamma = 1: every particle is the anchor, and the weights are uniform).
  after = jnp.where(decide, -jnp.log(spec.num_particles), all_log_w)
  kept = pf.normalize(jnp.where(jnp.isfinite(after), (1.0 - gamma) * after, -jnp.inf), spec.islands)
  synced = state.replace(
    log_weights=step_lib.local_slice(kept, num_local),
    params=params,
    batch_stats=outer_lib.pull(state.batch_stats, stats, gamma),
    opt_state=opt_state,
    anchor=anchor,
    outer_opt_state=outer_state,
    num_resamples=state.num_resamples + decide.astype(jnp.int32),
  )
  return synced, decide, src


def sync_step(c: OuterParts, state: ParticleState, batch, gamma, dims=None):
  """A local step followed by a sync: ``(state, metrics)``. When no particle is alive the sync is not applied
  (the local step's state is kept) and the step counts as skipped (the loop stops on it)."""
  key = jax.random.fold_in(state.rng, state.step)
  spec = dataclasses.replace(c.spec, common_examples=min(c.outer.sync_examples, batch_size(batch)))
  keys = particle_keys(stream(key, Stream.MODEL), state.log_weights.shape[0]) if c.task.rngs else None
  shared = jax.tree.map(lambda x: lax.pcast(x, (PARTICLE,), to="varying"), state.shared_params)
  score = step_lib.common_score(c.task, spec, state, shared, batch, keys, dims)
  new, g = local_update(c, state, batch, key, dims)
  alive = g.alive & jnp.isfinite(score) & jnp.isfinite(state.log_weights)
  all_log_w, tau, scores = sync_weights(c, new, score, alive)
  # The log line's diversity at a sync: each particle's distance to the anchor before the sync moves them (what a
  # step between syncs reports; after a full pull it would be ~0); none for a particle culled here
  drift = jnp.where(jnp.isfinite(all_log_w), fusion.distances(new, new.anchor, dims), jnp.nan)
  synced, resampled, src = synchronise(c, new, all_log_w, key, gamma, dims)
  ok = jnp.any(jnp.isfinite(all_log_w))
  synced = jax.tree.map(lambda a, b: jnp.where(ok, a, b), synced, new)
  synced = synced.replace(num_skipped=state.num_skipped + (~ok).astype(jnp.int32))
  metrics = local_metrics(c, state, synced, g)
  metrics.update(
    resampled=resampled & ok,
    synced=ok,
    ancestors=src,
    score=scores,
    ess=pf.ess(all_log_w, c.spec.islands),
    num_alive=jnp.sum(jnp.isfinite(all_log_w)).astype(jnp.int32),
    diversity=drift,
  )
  if c.spec.ess_target:
    metrics["temperature"] = tau
  return synced, metrics


def batch_size(batch) -> int:
  """Examples of one particle's part of this device's batch (``[L, b, ...]`` leaves)."""
  return jax.tree.leaves(batch)[0].shape[1]


def split_metrics(metrics: dict) -> tuple[dict, dict]:
  """``(per-particle, replicated)`` metrics, so ``shard_map``'s out_specs can be the prefixes
  ``(P("particle"), P())`` whatever the names."""
  return {k: v for k, v in metrics.items() if k in PER_PARTICLE}, {
    k: v for k, v in metrics.items() if k not in PER_PARTICLE
  }


class OuterTrainStep:
  """``train_step(state, batch) -> (state, metrics)`` of the outer loop: the local program, or the sync program
  where ``syncs[step]`` (``population.outer.sync_steps``; the last step with gamma = 0). ``at(step)`` is the
  program of step ``step`` (the loop's, which knows the step without asking the device); calling the object
  reads ``state.step``. Per-particle metrics leave sharded over ``"particle"`` (``PER_PARTICLE``): a local
  step has no collective over it, not even for its metrics."""

  def __init__(self, parts: OuterParts, mesh: jax.sharding.Mesh, syncs: np.ndarray):
    self.parts, self.syncs = parts, np.asarray(syncs, bool)

    def local(dims, state, batch):
      key = jax.random.fold_in(state.rng, state.step)
      new, g = local_update(parts, state, batch, key, dims)
      return new, split_metrics(local_metrics(parts, state, new, g))

    def sync(dims, state, batch, gamma):
      new, metrics = sync_step(parts, state, batch, gamma, dims)
      return new, split_metrics(metrics)

    out_specs = lambda specs: (specs, (P(PARTICLE), P()))
    self.local = jax.jit(merged(shard_map_on_state(local, mesh, (TRAIN_BATCH_SPEC,), out_specs)), donate_argnums=0)
    self.sync = jax.jit(merged(shard_map_on_state(sync, mesh, (TRAIN_BATCH_SPEC, P()), out_specs)), donate_argnums=0)
    self.pull = jnp.asarray(parts.outer.sync_pull, jnp.float32)

  def at(self, step: int) -> Callable:
    """The program of step ``step``: ``(state, batch) -> (state, metrics)``."""
    if step < len(self.syncs) and self.syncs[step]:
      gamma = self.pull if step < len(self.syncs) - 1 else jnp.zeros((), jnp.float32)
      return lambda state, batch: self.sync(state, batch, gamma)
    return self.local

  def __call__(self, state: ParticleState, batch) -> tuple[ParticleState, dict]:
    return self.at(int(state.step))(state, batch)


def merged(fn: Callable) -> Callable:
  """``fn``'s ``(state, (per-particle, replicated))`` as ``(state, metrics)``."""

  def call(*args):
    state, (per, rest) = fn(*args)
    return state, {**per, **rest}

  return call


def make_outer_train_step(
  task: Task,
  tx: optax.GradientTransformation,
  spec: ParticleSpec,
  outer: OuterSpec,
  mesh: jax.sharding.Mesh,
  syncs: np.ndarray,
  lr_fn: Optional[optax.Schedule] = None,
  exchange: Optional[exchange_lib.Exchange] = None,
) -> OuterTrainStep:
  """The outer loop's ``train_step`` (``OuterTrainStep``) for ``syncs`` (``[total]`` bool, the steps that end
  with a sync). ``spec``'s filter fields (temperature, forgetting, ess_target, ess_threshold, islands, jitter,
  the exchange) act at syncs only; its correction and elastic pull are not used."""
  parts = OuterParts(
    task,
    tx,
    spec,
    outer,
    outer_lib.outer_optimizer(outer.outer_lr, outer.outer_momentum),
    mesh.shape[PARTICLE],
    lr_fn,
    exchange or exchange_lib.exchange_fn(spec.resample_exchange),
  )
  return OuterTrainStep(parts, mesh, syncs)


def host_metrics(m: dict) -> dict:
  """A fetched step's metrics with what a local step could not compute without a collective: ``ess`` (of the
  whole population, islands or not) and ``num_alive`` (finite weights) from its ``[P]`` log-weights."""
  if "ess" in m:
    return m
  log_w = np.asarray(m["log_weights"], np.float64)
  alive = np.isfinite(log_w)
  w = np.exp(log_w - np.max(log_w[alive])) * alive if alive.any() else np.zeros_like(log_w)
  ess = float(w.sum() ** 2 / np.sum(w**2)) if alive.any() else 0.0
  return {**m, "ess": ess, "num_alive": int(alive.sum())}

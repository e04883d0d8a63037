"""The jitted ``shard_map`` train step (DESIGN.md §3), as five named phases.

  k = fold_in(rng, step)
  1. gradients:  l_i, g_i, beta_i' = value_and_grad(loss)(theta_i, beta_i, x_i)    (pmean over "data";
                 grad_accum_steps k: the mean over k micro-batches of x_i, one after another)
  2. reweigh:    log w_i <- rho log w_i - tau l_i, normalised over all particles   (one psum of the
                 per-particle numbers: ``Numbers``; weigh_on=common: l_i on common examples,
                 ess_target: tau_t adapted; islands: normalised within each island, 1 / G each)
  3. update:     d_i = (1 - lambda) g_i + lambda sum_j w_j g_j;  theta_i, mu_i <- opt(d_i, mu_i, theta_i)
  4. commit:     apply, or skip the whole step (nothing finite; a float16 overflow)
  5. resample:   if ESS < threshold P (or a particle was culled, or on schedule), and the step was
                 applied: copy survivors' particles over the others (``particle_filter.resample``; islands:
                 each island within itself)

Per-particle code is written for one particle and run over the ``L`` particles
of a device (``over_particles``); collectives name ``"particle"`` or ``"data"``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from ipf_jax.population import compression, correction
from ipf_jax.population import exchange as exchange_lib
from ipf_jax.population import particle_filter as pf
from ipf_jax.population.streams import Stream, stream
from ipf_jax.spmd import fsdp, loss_scaling, optim, sharing
from ipf_jax.spmd.layout import TRAIN_BATCH_SPEC
from ipf_jax.spmd.mesh import DATA, PARTICLE
from ipf_jax.spmd.particles import over_particles, particle_keys, per_particle, slot_keys
from ipf_jax.spmd.spec import ParticleSpec
from ipf_jax.spmd.state import ParticleState, shard_map_on_state
from ipf_jax.spmd.task import Task

# Metrics leave the step replicated (per-particle ones gathered to [P]), so any
# process of a multi-host run can read them.
TRAIN_METRIC_SPECS = P()


def _all_finite(tree):
  """``[L]`` bool: every entry of the particle's leaves is finite."""
  leaves = [jnp.isfinite(x).reshape(x.shape[0], -1).all(axis=1) for x in jax.tree.leaves(tree)]
  return jnp.stack(leaves).all(axis=0)


# ---- 1. gradients ------------------------------------------------------------------------------------------------


class Gradients(NamedTuple):
  """Phase 1's output for the ``L`` local particles (gradients of culled particles are zeros)."""

  loss: jax.Array  # [L]
  grads: Any
  shared_grads: Any
  batch_stats: Any
  alive: jax.Array  # [L] bool: loss and gradient finite
  vote: Optional[loss_scaling.Vote]  # float16: each particle's say in the next loss scale; None otherwise
  score: Optional[jax.Array] = None  # [L] weigh_on=common: the loss on the common examples (None: ``loss``)


def gradients(task: Task, spec: ParticleSpec, state: ParticleState, batch: dict, key, dims=None) -> Gradients:
  """Each particle's loss over its whole data group (``pmean`` over ``"data"``) and its gradient.

  Shared parameters are marked device-varying so that each particle gets its own gradient.
  float16: the state's loss-scaling policy scales the loss, unscales the gradients and takes each
  particle's vote on the next scale (``loss_scaling``).
  No NaN leaves a culled particle: its gradients are replaced by zeros (``where``, not ``*``).
  ``config.fsdp``: the particle is gathered from its shards (``dims``) for the forward pass, and each device's
  gradient is its shard of the group's (the gather's transpose, a reduce-scatter).
  """
  scaling = loss_scaling.of(state)
  sharded = fsdp.is_sharded(dims)

  def loss_fn(params, shared, batch_stats, batch, keys):
    model_key, augment_key, position = keys
    if task.augment is not None:  # mixup: the particle's examples and targets, mixed; per slot: its own strength
      if task.augment_takes_position:
        batch = task.augment(batch, augment_key, position)
      else:
        batch = task.augment(batch, augment_key)
    outputs, new_stats = apply_particle(task, spec, params, shared, batch_stats, batch, model_key, dims)
    return lax.pmean(task.loss(outputs, batch).mean(), DATA), new_stats

  grad_fn = scaling.value_and_grad(loss_fn, argnums=(0, 1))
  shared = jax.tree.map(lambda x: lax.pcast(x, (PARTICLE,), to="varying"), state.shared_params)
  num_local = state.log_weights.shape[0]
  run = over_particles(grad_fn, spec.particle_loop, (0, None, 0, 0, 0))

  def micro_step(batch_stats, micro_batch, m):
    def micro_key(purpose):
      return stream(key, purpose) if spec.grad_accum_steps == 1 else jax.random.fold_in(stream(key, purpose), m)

    keys = (
      particle_keys(micro_key(Stream.MODEL), num_local) if task.rngs else None,
      slot_keys(micro_key(Stream.AUGMENT), num_local) if task.augment is not None else None,
      positions(spec.num_particles, num_local) if task.augment_takes_position else None,
    )
    (loss, batch_stats), (grads, shared_grads), proposed = run(state.params, shared, batch_stats, micro_batch, keys)
    return loss, batch_stats, grads, shared_grads, proposed

  if spec.grad_accum_steps == 1:
    loss, batch_stats, grads, shared_grads, proposed = micro_step(state.batch_stats, batch, 0)
  else:
    loss, batch_stats, grads, shared_grads, proposed = accumulate(
      micro_step, spec.grad_accum_steps, state.batch_stats, batch, scaling.merge
    )
  if sharded:
    finite = fsdp.all_finite((grads, shared_grads), (dims, fsdp.replicated(shared_grads)))
  else:
    finite = _all_finite((grads, shared_grads))
  alive = jnp.isfinite(loss) & finite
  score = None
  if spec.weigh_on == "common":
    keys = particle_keys(stream(key, Stream.MODEL), num_local) if task.rngs else None
    score = common_score(task, spec, state, shared, batch, keys, dims)
    alive &= jnp.isfinite(score)
  grads, shared_grads = jax.tree.map(lambda g: jnp.where(per_particle(alive, g), g, 0), (grads, shared_grads))
  return Gradients(loss, grads, shared_grads, batch_stats, alive, scaling.vote(proposed, loss, alive), score)


def positions(num_particles: int, num_local: int) -> jax.Array:
  """``[L]``: each local particle's place in the population, ``slot / (P - 1)`` in ``[0, 1]`` (0 with one)."""
  slots = lax.axis_index(PARTICLE) * num_local + jnp.arange(num_local)
  return slots.astype(jnp.float32) / max(num_particles - 1, 1)


def apply_particle(task: Task, spec: ParticleSpec, params, shared, batch_stats, batch: dict, key, dims=None):
  """One particle's ``task.apply`` in train mode: ``(outputs, batch_stats)``. ``config.fsdp``: its leaves are a
  device's shards (``dims``), gathered here; with ``fsdp_gather="block"`` except those of the model's blocks
  (``task.blocks``), which each block gathers as it runs (``models.blocks``: under ``remat`` one block at a
  time)."""
  variables = lambda params: {"params": sharing.merge(params, shared), "batch_stats": batch_stats}
  if not gathers_per_block(spec, task, dims):
    return task.apply(variables(fsdp.gather(params, dims)), batch, True, key)
  with fsdp.BlockGather(dims, task.blocks) as gather:
    return task.apply(variables(gather.outside(params)), batch, True, key)


def gathers_per_block(spec: ParticleSpec, task: Task, dims) -> bool:
  """Whether ``apply_particle`` leaves the model's blocks to gather their own parameters: ``fsdp_gather=
  "block"``, a model that declares its blocks (``task.blocks``) and a leaf of them sharded (``dims``). A
  pattern that matches no leaf's module goes per block too, so that the first block names it."""
  if spec.fsdp_gather != "block" or not task.blocks or not fsdp.is_sharded(dims):
    return False
  gather = fsdp.BlockGather(dims, task.blocks)
  return bool(gather.inside) or not gather.matched


def how_gathered(spec: ParticleSpec, task: Task, dims) -> str:
  """What the run's log says of ``apply_particle``'s gather (``gathers_per_block``, and why not)."""
  if gathers_per_block(spec, task, dims):
    return "each block gathers its own"
  if spec.fsdp_gather == "block" and not task.blocks:
    return "gathered whole: fsdp_gather='block', but the model declares no blocks (Task.blocks)"
  if spec.fsdp_gather == "block":
    return "gathered whole: fsdp_gather='block', but no leaf of the blocks is sharded"
  return "gathered whole for each forward pass"


def micro_batches(batch: dict, k: int) -> dict:
  """``[L, b, ...]`` leaves to ``[k, L, b / k, ...]``: micro-batch ``m`` holds examples ``m, m + k, ...`` of
  every particle's part of the shard, so a particle's micro-batches do not depend on the mesh."""
  return jax.tree.map(lambda x: jnp.moveaxis(x.reshape(x.shape[:1] + (x.shape[1] // k, k) + x.shape[2:]), 2, 0), batch)


def accumulate(micro_step: Callable, k: int, batch_stats, batch: dict, merge: Callable):
  """Gradient accumulation inside the step: ``micro_step`` on each of ``k`` micro-batches in turn (a ``scan``;
  BatchNorm statistics carried from one to the next), then the mean loss and mean gradients, as one
  step on the whole batch would give without BatchNorm. float16: every micro-batch proposes the next
  loss scale from the same one; ``merge`` (the policy's) keeps the smallest (an overflow anywhere halves it)."""
  micro = micro_batches(batch, k)
  first = micro_step(batch_stats, jax.tree.map(lambda x: x[0], micro), 0)

  def body(carry, xs):
    loss, stats, grads, shared_grads, proposed = carry
    m_loss, stats, m_grads, m_shared, m_proposed = micro_step(stats, xs[0], xs[1])
    add = lambda a, b: jax.tree.map(jnp.add, a, b)
    return (loss + m_loss, stats, add(grads, m_grads), add(shared_grads, m_shared), merge(proposed, m_proposed)), None

  rest = (jax.tree.map(lambda x: x[1:], micro), jnp.arange(1, k))
  (loss, stats, grads, shared_grads, proposed), _ = lax.scan(body, first, rest)
  mean = lambda tree: jax.tree.map(lambda x: x / k, tree)
  return loss / k, stats, mean(grads), mean(shared_grads), proposed


def common_score(task: Task, spec: ParticleSpec, state: ParticleState, shared, batch: dict, keys, dims=None):
  """``[L]``: each particle's loss (train mode, forward only) on the same examples: the first
  ``common_examples`` of every particle's part of this data shard's batch, gathered over ``"particle"``
  (``P x common_examples`` examples per data shard; ``pmean`` over ``"data"``). Every particle of the
  population is weighed on the same examples, so the weights compare particles, not batches."""
  k = spec.common_examples
  mine = jax.tree.map(lambda x: x[:, :k].reshape((-1,) + x.shape[2:]), batch)  # [L k, ...]
  common = jax.tree.map(lambda x: pf.gather_all(x, PARTICLE), mine)  # [P k, ...], the same on every particle

  def score_fn(params, shared, batch_stats, key):
    outputs, _ = apply_particle(task, spec, params, shared, batch_stats, common, key, dims)
    return lax.pmean(task.loss(outputs, common).mean(), DATA)

  run = over_particles(score_fn, spec.particle_loop, (0, None, 0, 0 if task.rngs else None))
  return run(state.params, shared, state.batch_stats, keys)


# ---- 2. reweigh ----------------------------------------------------------------------------------------------------


class Numbers(NamedTuple):
  """The per-particle numbers every device needs, gathered to ``[P]`` in one ``psum``."""

  log_weight: jax.Array  # unnormalised: rho log w - tau loss, -inf if culled
  loss: jax.Array
  alive: jax.Array  # 1.0 / 0.0
  grad_norm: jax.Array
  vote: Optional[loss_scaling.Vote] = None  # float16 only
  previous_log_weight: Optional[jax.Array] = None  # float16 and ess_target only
  score: Optional[jax.Array] = None  # weigh_on=common: what the weights use instead of ``loss``


def gather_numbers(numbers: Numbers) -> Numbers:
  """``[L]`` fields to ``[P]`` ones, identical on every device: one ``psum`` of the stacked table (the
  fields that are not None, the vote's flattened)."""
  columns, tree = jax.tree.flatten(numbers)
  table = pf.gather_all(jnp.stack(columns, axis=1), PARTICLE)
  return jax.tree.unflatten(tree, [table[:, i] for i in range(len(columns))])


def reweigh(spec: ParticleSpec, state: ParticleState, g: Gradients, dims=None) -> tuple[Numbers, jax.Array, jax.Array]:
  """``(numbers [P], all_log_w [P], tau)``: ``log w_i <- rho log w_i - tau l_i`` normalised over all ``P``
  particles (replicated; ``islands``: within each island, ``particle_filter.normalize``); a culled particle gets
  ``-inf``. ``tau`` is ``temperature``, or with ``ess_target`` the largest ``tau <= temperature`` that keeps
  the ESS at ``ess_target * P`` (``particle_filter.adaptive_temperature``)."""
  score = g.loss if g.score is None else g.score
  raw = pf.update_log_weights(state.log_weights, score, g.alive, spec.temperature, spec.forgetting)
  if fsdp.is_sharded(dims):  # the shards' squares summed over "data"
    grad_norm = jnp.sqrt(fsdp.squared_norms((g.grads, g.shared_grads), (dims, fsdp.replicated(g.shared_grads))))
  else:
    grad_norm = jax.vmap(optax.tree.norm)((g.grads, g.shared_grads))
  numbers = Numbers(raw, g.loss, g.alive.astype(g.loss.dtype), grad_norm, vote=g.vote, score=g.score)
  if g.vote is not None or spec.ess_target:
    numbers = numbers._replace(previous_log_weight=state.log_weights)
  numbers = gather_numbers(numbers)
  temperature = jnp.asarray(spec.temperature, g.loss.dtype)
  if spec.ess_target:  # tau_t: the largest tau <= temperature that keeps the ESS at the target
    alive = numbers.alive > 0
    score = numbers.loss if numbers.score is None else numbers.score
    temperature = pf.adaptive_temperature(
      numbers.previous_log_weight,
      score,
      alive,
      spec.temperature,
      spec.forgetting,
      spec.ess_target * spec.num_particles,
      islands=spec.islands,
    )
    numbers = numbers._replace(
      log_weight=pf.update_log_weights(numbers.previous_log_weight, score, alive, temperature, spec.forgetting)
    )
  return numbers, pf.normalize(numbers.log_weight, spec.islands), temperature


def local_slice(all_values, num_local: int):
  """This device's ``[L]`` block of a replicated ``[P]`` vector."""
  return lax.dynamic_slice_in_dim(all_values, lax.axis_index(PARTICLE) * num_local, num_local)


# ---- 3. correct and update -------------------------------------------------------------------------------------


def update_sharded(tx: optax.GradientTransformation, dims, directions, opt_state, params):
  """One particle's ``tx.update``, told the layout of its shards when it is sharded over ``"data"`` (FSDP): the
  extra argument ``optim.SHARD_DIMS``, which the built-in clipping reads to norm the whole particle."""
  if not fsdp.is_sharded(dims):
    return tx.update(directions, opt_state, params)
  try:
    return optax.with_extra_args_support(tx).update(directions, opt_state, params, **{optim.SHARD_DIMS: dims})
  except TypeError as e:  # a user's transformation that takes no unknown extra argument: it cannot use them
    if optim.SHARD_DIMS not in str(e):
      raise
    return tx.update(directions, opt_state, params)


def correct_and_update(
  tx: optax.GradientTransformation, spec: ParticleSpec, dp: int, state: ParticleState, g: Gradients, weights, dims=None
):
  """The filter's phase 3: ``d_i = (1 - lambda) g_i + lambda sum_j w_j g_j`` (optionally compressed, with error
  feedback), ``theta_i, mu_i <- opt(d_i, mu_i, theta_i)`` (``update_each``), then the optional elastic pull
  ``theta_i <- (1 - alpha) theta_i + alpha sum_j w_j theta_j`` (on steps ``k, 2k, ...`` with
  ``elastic_pull_every = k``)."""
  residual = state.residual
  if spec.compress_correction and dp > 1:
    consensus, residual = compression.compressed_consensus(g.grads, weights, residual, PARTICLE, dp)
    directions = correction.mix(g.grads, consensus, spec.correction)
  else:
    directions = correction.correct(g.grads, weights, spec.correction, PARTICLE)
  updated, shared, shared_opt_state = update_each(tx, spec, dp, state, g, weights, dims, directions)
  params, batch_stats, opt_state, _ = updated
  if spec.elastic_pull and spec.elastic_pull_every > 1:  # a gentle pull: every k-th step only, its psum skipped
    pull = lambda p: correction.correct(p, weights, spec.elastic_pull, PARTICLE)
    params = lax.cond((state.step + 1) % spec.elastic_pull_every == 0, pull, lambda p: p, params)
  else:
    params = correction.correct(params, weights, spec.elastic_pull, PARTICLE)
  return (params, batch_stats, opt_state, residual), shared, shared_opt_state


def update_each(
  tx: optax.GradientTransformation,
  spec: ParticleSpec,
  dp: int,
  state: ParticleState,
  g: Gradients,
  weights,
  dims=None,
  directions=None,
):
  """Phase 3 without a correction (``ddp``, ``ensemble``): ``theta_i, mu_i <- opt(d_i, mu_i, theta_i)`` with
  ``d_i`` the particle's own gradient (or ``directions``). Shared parameters take one update with the weighted
  consensus gradient (lambda = 1 for them). ``config.fsdp``: the leaves are shards (``dims``), each updated on its
  own (an element-wise optimizer).

  Returns ``(particle, shared_params, shared_opt_state)`` with ``particle = (params, batch_stats, opt_state,
  residual)``: everything that moves with a particle in resampling."""
  directions = g.grads if directions is None else directions
  updates, opt_state = jax.vmap(functools.partial(update_sharded, tx, dims))(directions, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  shared_updates, shared_opt_state = tx.update(
    correction.weighted_sum(g.shared_grads, weights, PARTICLE), state.shared_opt_state, state.shared_params
  )
  shared_params = optax.apply_updates(state.shared_params, shared_updates)
  return (params, g.batch_stats, opt_state, state.residual), shared_params, shared_opt_state


# ---- 4. commit and 5. resample --------------------------------------------------------------------------------


def resample_decision(spec: ParticleSpec, step, ess, num_alive):
  """Low ESS, a culled particle to replace (while any is alive), or the schedule."""
  num = spec.num_particles
  decide = (ess < spec.ess_threshold * num) | ((num_alive < num) & (num_alive > 0))
  if spec.resample_every:
    decide |= (step + 1) % spec.resample_every == 0
  return decide


def jitter_sigma(spec: ParticleSpec, lr_fn: Optional[optax.Schedule], step):
  """The noise on resampled copies: ``jitter + jitter_lr * lr(step)`` (a float when ``jitter_lr`` is 0)."""
  if not spec.jitter_lr:
    return spec.jitter
  if lr_fn is None:
    raise ValueError("jitter_lr needs the learning-rate schedule: make_train_step(..., lr_fn=...)")
  return spec.jitter + spec.jitter_lr * lr_fn(step)


def updates_done(state: ParticleState):
  """The optimizer's update count before this step: steps minus those skipped whole (nothing finite, or a
  float16 overflow), which keep the optimizer state and so its schedule's count."""
  overflows = 0 if state.num_overflows is None else state.num_overflows
  return state.step - state.num_skipped - overflows


def commit(state: ParticleState, ok, particle, log_w, shared_params, shared_opt_state) -> ParticleState:
  """Phase 4: the update applied where ``ok``, else the whole state kept (a skipped step). It comes before
  the resampling, so the old state is dead while particles move (the exchange's buffers then add nothing
  to the step's peak memory)."""
  params, batch_stats, opt_state, residual = particle
  updated = state.replace(
    params=params,
    batch_stats=batch_stats,
    opt_state=opt_state,
    residual=residual,
    log_weights=log_w,
    shared_params=shared_params,
    shared_opt_state=shared_opt_state,
  )
  return jax.tree.map(lambda new, old: jnp.where(ok, new, old), updated, state)


def resample_phase(
  spec: ParticleSpec,
  dp: int,
  state: ParticleState,
  key,
  all_log_w,
  decide,
  sigma,
  exchange: exchange_lib.Exchange,
  dims=None,
):
  """Phase 5: ``(state, src [P])``; where ``decide`` (replicated), the committed population resampled
  (``particle_filter.resample``: survivors in place, weights uniform, particles moved by ``exchange``), else
  unchanged with ``src`` the identity."""
  identity = jnp.arange(spec.num_particles, dtype=jnp.int32)

  def resample(particle, log_w):
    return pf.resample(
      key,
      particle,
      log_w,
      all_log_w,
      dp,
      sigma,
      exchange=exchange,
      islands=spec.islands,
      shards=fsdp.shards(dims),
      place=pf.PLACEMENTS[spec.resample_placement],
    )

  particle = (state.params, state.batch_stats, state.opt_state, state.residual)
  (params, batch_stats, opt_state, residual), log_w, src = lax.cond(
    decide, resample, lambda p, w: (p, w, identity), particle, state.log_weights
  )
  return state.replace(
    params=params, batch_stats=batch_stats, opt_state=opt_state, residual=residual, log_weights=log_w
  ), src


class Outcome(NamedTuple):
  """What phases 2-5 decided, as the metrics report it."""

  numbers: Numbers  # [P], gathered
  all_log_w: jax.Array  # [P] normalised
  ess: jax.Array
  num_alive: jax.Array
  resampled: jax.Array  # bool
  src: jax.Array  # [P] ancestors (the identity when not resampled)
  temperature: jax.Array  # the tau used (ess_target: adapted)
  overflow: jax.Array  # bool: a float16 overflow skipped the step


def step_metrics(spec: ParticleSpec, scaling: loss_scaling.Policy, o: Outcome, lr=None) -> dict:
  """What the step reports, replicated (per-particle values ``[P]``); ``lr``: the learning rate the optimizer
  applies at this step (with ``lr_fn``). float16: an overflow step culls nobody and keeps the weights, so it
  reports them as they were, not the discarded update."""
  numbers = o.numbers
  metrics = {
    "loss": numbers.loss,
    "alive": numbers.alive.astype(jnp.int32),
    "grad_norm": numbers.grad_norm,
    "log_weights": o.all_log_w,
    "ess": o.ess,
    "resampled": o.resampled,
    "ancestors": o.src,
    "num_alive": o.num_alive,
  }
  if lr is not None:
    metrics["lr"] = jnp.asarray(lr, jnp.float32)
  if spec.ess_target:
    metrics["temperature"] = o.temperature
  if numbers.score is not None:
    metrics["score"] = numbers.score
  return scaling.metrics(spec, metrics, numbers.vote, numbers.previous_log_weight, o.overflow)


def count(state: ParticleState, new_state: ParticleState, ok, overflow, resampled) -> ParticleState:
  """The step's counters: one more step, and whether it was skipped or a resampling (overflows: the policy's)."""
  return new_state.replace(
    step=state.step + 1,
    num_skipped=state.num_skipped + (~ok & ~overflow).astype(jnp.int32),
    num_resamples=state.num_resamples + resampled.astype(jnp.int32),
  )


class Phases(NamedTuple):
  """The per-step program's phases 2, 3 and 5 as functions, handed to ``local_step`` the way blackjax's SMC step
  takes its update, weight and resample functions: each mode is a preset (``INDEPENDENT``, ``FILTER``; the outer
  loop is its own pair of programs, ``outer_step``), and a library user may hand ``make_train_step`` others of
  the same signatures."""

  weigh: Callable  # (spec, state, g, dims) -> (numbers [P], all_log_w [P], tau): ``reweigh``
  update: Callable  # (tx, spec, dp, state, g, weights [L], dims) -> (particle, shared_params, shared_opt_state)
  resample: Optional[Callable]  # (spec, dp, state, key, all_log_w, decide, sigma, exchange, dims) -> (state, src)


# ddp and ensemble: the weights only observe (temperature 0: a culled particle's is -inf), no correction, no
# resampling. ipf with sync='step' (the seed's literal reading): the filter every step.
INDEPENDENT = Phases(weigh=reweigh, update=update_each, resample=None)
FILTER = Phases(weigh=reweigh, update=correct_and_update, resample=resample_phase)


def preset(spec: ParticleSpec) -> Phases:
  """The mode's phases: ``FILTER`` where the spec resamples (ipf with several particles) or mixes the particles
  (a correction or an elastic pull, which a library user's spec may ask for without resampling), else
  ``INDEPENDENT``."""
  return FILTER if spec.resampling or spec.correction or spec.elastic_pull else INDEPENDENT


class StepParts(NamedTuple):
  """What a train step is built from: ``make_train_step``'s arguments, ``dp`` the mesh's particle axis."""

  task: Task
  tx: optax.GradientTransformation
  spec: ParticleSpec
  dp: int
  lr_fn: Optional[optax.Schedule]
  exchange: exchange_lib.Exchange
  phases: Phases


def local_step(c: StepParts, dims, state: ParticleState, batch):
  """One device's part of the train step, phase by phase (the module docstring's 1-5). ``dims``: which of the
  state's parameter leaves are shards over ``"data"`` (``fsdp.dims_of`` its specs, which ``shard_map_on_state``
  reads from the state it is given: the layout travels with the state)."""
  spec, scaling = c.spec, loss_scaling.of(state)
  step_key = jax.random.fold_in(state.rng, state.step)
  g = gradients(c.task, spec, state, batch, step_key, dims)  # 1
  numbers, all_log_w, temperature = c.phases.weigh(spec, state, g, dims)  # 2
  log_w = local_slice(all_log_w, state.log_weights.shape[0])
  particle, shared_params, shared_opt_state = c.phases.update(c.tx, spec, c.dp, state, g, jnp.exp(log_w), dims)  # 3
  ess = pf.ess(all_log_w, spec.islands)
  num_alive = jnp.sum(numbers.alive).astype(jnp.int32)
  # 4. Commit, or skip the whole step: nothing finite (DDP's skipped step) or a float16 overflow.
  scale, overflow = scaling.decide(numbers.vote)
  ok = (num_alive > 0) & ~overflow
  new_state = commit(state, ok, particle, log_w, shared_params, shared_opt_state)
  # 5. Resample the committed population (skipped steps never resample).
  resampled, src = jnp.zeros((), bool), jnp.arange(spec.num_particles, dtype=jnp.int32)
  if c.phases.resample is not None:
    resampled = resample_decision(spec, state.step, ess, num_alive) & ok
    sigma = jitter_sigma(spec, c.lr_fn, state.step)
    new_state, src = c.phases.resample(spec, c.dp, new_state, step_key, all_log_w, resampled, sigma, c.exchange, dims)
  new_state = scaling.count(state, count(state, new_state, ok, overflow, resampled), scale, overflow)
  outcome = Outcome(numbers, all_log_w, ess, num_alive, resampled, src, temperature, overflow)
  return new_state, step_metrics(spec, scaling, outcome, None if c.lr_fn is None else c.lr_fn(updates_done(state)))


def make_train_step(
  task: Task,
  tx: optax.GradientTransformation,
  spec: ParticleSpec,
  mesh: jax.sharding.Mesh,
  lr_fn: Optional[optax.Schedule] = None,
  exchange: Optional[exchange_lib.Exchange] = None,
  phases: Optional[Phases] = None,
) -> Callable:
  """``train_step(state, batch) -> (state, metrics)``, one jitted SPMD program.

  ``batch`` is a dict of ``[P, B, ...]`` arrays sharded ``P("particle", "data")`` (particle ``i``
  trains on ``batch[...][i]``); ``task.model`` must synchronise BatchNorm over ``"data"``. ``state``
  is donated. ``lr_fn(step)``, the learning rate at train step ``step``, is needed for ``spec.jitter_lr``;
  with it the metrics hold ``lr``, the schedule at the optimizer's count (``updates_done``: steps skipped
  whole apply no update, so the count lags ``state.step`` by them). ``exchange`` moves resampled particles
  (``population.exchange.Exchange``; default ``population.exchange.exchange_fn(spec.resample_exchange)``; unused
  where ``spec.resampling`` is off: ensemble, DDP). ``phases``: the weighing, update and resampling (``Phases``;
  default the mode's preset, ``preset(spec)``).
  """
  exchange = exchange or exchange_lib.exchange_fn(spec.resample_exchange)
  parts = StepParts(task, tx, spec, mesh.shape[PARTICLE], lr_fn, exchange, phases or preset(spec))

  out_specs = lambda specs: (specs, TRAIN_METRIC_SPECS)
  sharded = shard_map_on_state(functools.partial(local_step, parts), mesh, (TRAIN_BATCH_SPEC,), out_specs)
  return jax.jit(sharded, donate_argnums=0)

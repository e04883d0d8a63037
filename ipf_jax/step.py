"""The jitted ``shard_map`` train and eval steps (DESIGN.md §3).

Per-particle code is written for one particle and vmapped over the ``L``
particles of a device; collectives name ``"particle"`` or ``"data"``.
"""
from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from ipf_jax import compression
from ipf_jax import correction
from ipf_jax import filter as pf
from ipf_jax import metrics as metrics_lib
from ipf_jax import sharing
from ipf_jax.configuration import ParticleSpec
from ipf_jax.mesh import DATA, PARTICLE
from ipf_jax.state import ParticleState, state_specs

BATCH_SPEC = {"image": P(PARTICLE, DATA), "label": P(PARTICLE, DATA)}
EVAL_BATCH_SPEC = {"image": P(DATA), "label": P(DATA), "mask": P(DATA)}
# Metrics leave the step replicated (per-particle ones gathered to [P]), so any
# process of a multi-host run can read them.
TRAIN_METRIC_SPECS = P()


def _per_particle(mask, x):
  """Broadcast an ``[L]`` mask against an ``[L, ...]`` leaf."""
  return mask.reshape(mask.shape + (1,) * (x.ndim - 1))


def _all_finite(tree):
  """``[L]`` bool: every entry of the particle's leaves is finite."""
  leaves = [jnp.isfinite(x).reshape(x.shape[0], -1).all(axis=1) for x in jax.tree.leaves(tree)]
  return jnp.stack(leaves).all(axis=0)


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


def _jitter(params, src, key, sigma, num_local):
  """``theta += sigma * eps`` on slots that received a copy (``src[n] != n``).

  Slot ``n``'s noise comes from ``fold_in(key, n)``, leaf ``k`` from
  ``fold_in(that, k)``: the same on any mesh.
  """
  first = lax.axis_index(PARTICLE) * num_local
  slots = first + jnp.arange(num_local)
  copied = lax.dynamic_slice_in_dim(src, first, num_local) != slots
  leaves, treedef = jax.tree.flatten(params)

  def noise(slot):
    k = jax.random.fold_in(key, slot)
    return [jax.random.normal(jax.random.fold_in(k, i), x.shape[1:], x.dtype) for i, x in enumerate(leaves)]

  eps = jax.vmap(noise)(slots)
  out = [x + sigma * jnp.where(_per_particle(copied, x), e, 0) for x, e in zip(leaves, eps)]
  return jax.tree.unflatten(treedef, out)


def make_train_step(model: nn.Module, tx: optax.GradientTransformation, spec: ParticleSpec,
                    mesh: jax.sharding.Mesh, label_smoothing: float = 0.0, particle_loop: str = "vmap") -> Callable:
  """``train_step(state, batch) -> (state, metrics)``, one jitted SPMD program.

  ``batch`` is ``{"image": [P, B, ...], "label": [P, B]}`` sharded
  ``P("particle", "data")``; ``model`` must synchronise BatchNorm over
  ``"data"`` (``bn_axis_name="data"``). ``state`` is donated.
  """
  num_particles = spec.num_particles
  dp = mesh.shape[PARTICLE]

  def loss_fn(params, shared, batch_stats, image, label):
    logits, new_vars = model.apply({"params": sharing.merge(params, shared), "batch_stats": batch_stats}, image,
                                   train=True, mutable=["batch_stats"])
    if label_smoothing:
      targets = optax.smooth_labels(jax.nn.one_hot(label, logits.shape[-1]), label_smoothing)
      loss = optax.softmax_cross_entropy(logits, targets).mean()
    else:
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, label).mean()
    # The particle's loss over its whole data group; its gradient is the group mean.
    return lax.pmean(loss, DATA), new_vars["batch_stats"]

  def resample(step_key, particle, log_w, all_log_w):
    """Systematic resampling, survivors in place, exchange, weights reset."""
    u = jax.random.uniform(jax.random.fold_in(step_key, 0))
    src = pf.assign_slots(pf.systematic_resample(u, all_log_w))
    params, *rest = pf.exchange(particle, src, PARTICLE, dp)
    if spec.jitter:
      params = _jitter(params, src, jax.random.fold_in(step_key, 1), spec.jitter, log_w.shape[0])
    uniform = jnp.full_like(log_w, -jnp.log(num_particles))
    return (params, *rest), uniform, src

  def local_step(state: ParticleState, batch):
    step_key = jax.random.fold_in(state.rng, state.step)
    # 1. Local gradients, one particle at a time (vmapped), averaged over "data". Shared
    #    parameters are marked device-varying so that each particle gets its own gradient.
    #    float16: flax's DynamicScale scales the loss and unscales the gradients; each particle
    #    proposes the next scale, and one decision for all is taken from the gathered table below.
    ds = state.dynamic_scale

    def grad_fn(*args):
      if ds is None:
        return (*jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(*args), None)
      proposed, _, aux, grads = ds.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(*args)
      return aux, grads, proposed

    shared = jax.tree.map(lambda x: lax.pcast(x, (PARTICLE,), to="varying"), state.shared_params)
    (loss, batch_stats), (grads, shared_grads), proposed = over_particles(grad_fn, particle_loop, (0, None, 0, 0, 0))(
        state.params, shared, state.batch_stats, batch["image"], batch["label"])
    loss_finite = jnp.isfinite(loss)
    alive = loss_finite & _all_finite((grads, shared_grads))
    # No NaN leaves a culled particle.
    grads, shared_grads = jax.tree.map(lambda g: jnp.where(_per_particle(alive, g), g, 0), (grads, shared_grads))
    # 2. Importance weights. The per-particle numbers of all particles travel in one psum;
    #    normalisation, ESS and the resampling decision are then computed replicated.
    num_local = loss.shape[0]
    raw_log_w = pf.update_log_weights(state.log_weights, loss, alive, spec.temperature, spec.forgetting)
    grad_norm = jax.vmap(optax.tree.norm)((grads, shared_grads))
    columns = [raw_log_w, loss, alive.astype(loss.dtype), grad_norm]
    if ds is not None:
      # A finite loss with a non-finite gradient is an overflow. Particles whose loss is not
      # finite have diverged: they are culled and take no part in the scale's decision.
      columns += [(loss_finite & ~alive).astype(loss.dtype), jnp.where(loss_finite, proposed.scale, jnp.inf),
                  jnp.where(loss_finite, proposed.fin_steps, jnp.inf), state.log_weights]
    table = pf.gather_all(jnp.stack(columns, axis=1), PARTICLE)
    all_log_w = pf.normalize(table[:, 0])
    log_w = lax.dynamic_slice_in_dim(all_log_w, lax.axis_index(PARTICLE) * num_local, num_local)
    weights = jnp.exp(log_w)
    # 3. Weighted global correction (optionally compressed, with error feedback).
    residual = state.residual
    if spec.compress and dp > 1:
      consensus, residual = compression.compressed_consensus(grads, weights, residual, PARTICLE, dp)
      directions = correction.mix(grads, consensus, spec.correction)
    else:
      directions = correction.correct(grads, weights, spec.correction, PARTICLE)
    # 4. Per-particle optimizer update.
    updates, opt_state = jax.vmap(tx.update)(directions, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # Optional elastic pull towards the fused parameters: theta_i <- (1 - alpha) theta_i + alpha theta_bar.
    params = correction.correct(params, weights, spec.elastic, PARTICLE)
    particle = (params, batch_stats, opt_state, residual)
    # Shared parameters: one update with the weighted consensus gradient (lambda = 1 for them).
    shared_updates, shared_opt_state = tx.update(correction.weighted_sum(shared_grads, weights, PARTICLE),
                                                 state.shared_opt_state, state.shared_params)
    shared_params = optax.apply_updates(state.shared_params, shared_updates)
    # 5. Resampling, decided inside the step: low ESS, a culled particle to replace, or the schedule.
    ess = pf.ess(all_log_w)
    num_alive = jnp.sum(table[:, 2]).astype(jnp.int32)
    new_log_w, src, resampled = log_w, jnp.arange(num_particles, dtype=jnp.int32), jnp.zeros((), bool)
    if spec.resampling:
      resampled = (ess < spec.ess_threshold * num_particles) | ((num_alive < num_particles) & (num_alive > 0))
      if spec.resample_every:
        resampled |= (state.step + 1) % spec.resample_every == 0
      particle, new_log_w, src = lax.cond(resampled, lambda p, w: resample(step_key, p, w, all_log_w),
                                          lambda p, w: (p, w, src), particle, log_w)
    # 6. Apply, or skip the whole step: nothing finite (DDP's skipped step) or a float16 overflow.
    overflow = jnp.zeros((), bool)
    if ds is not None:
      # Above the minimum scale, an overflow halves the scale and the step is retried on the next batch
      # by every particle; at the minimum, a non-finite gradient is a divergence and culls as in float32.
      overflow = (jnp.sum(table[:, 4]) > 0) & (ds.scale > ds.minimum_scale)
    ok = (num_alive > 0) & ~overflow
    params, batch_stats, opt_state, residual = particle
    updated = state.replace(params=params, batch_stats=batch_stats, opt_state=opt_state, residual=residual,
                            log_weights=new_log_w,
                            num_resamples=state.num_resamples + resampled.astype(jnp.int32),
                            shared_params=shared_params, shared_opt_state=shared_opt_state)
    new_state = jax.tree.map(lambda new, old: jnp.where(ok, new, old), updated, state)
    new_state = new_state.replace(step=state.step + 1,
                                  num_skipped=state.num_skipped + (~ok & ~overflow).astype(jnp.int32))
    metrics = {"loss": table[:, 1], "alive": table[:, 2].astype(jnp.int32), "grad_norm": table[:, 3],
               "log_weights": all_log_w, "ess": ess, "resampled": resampled & ok,
               "ancestors": jnp.where(resampled & ok, src, jnp.arange(num_particles, dtype=jnp.int32)),
               "num_alive": num_alive}
    if ds is not None:
      # Every proposal is the same when all gradients are finite, and a backed-off one otherwise:
      # the smallest is the decision for all. No finite loss at all: the scale stays.
      scale = jnp.min(table[:, 5])
      decided = ds.replace(scale=scale, fin_steps=jnp.min(table[:, 6]).astype(jnp.int32))
      new_state = new_state.replace(
          dynamic_scale=jax.tree.map(lambda new, old: jnp.where(jnp.isfinite(scale), new, old), decided, ds),
          num_overflows=state.num_overflows + overflow.astype(jnp.int32))
      metrics.update(loss_scale=ds.scale, overflow=overflow)
      # An overflow step culls nobody and keeps the weights: report them so, not the discarded update.
      finite = (table[:, 2] + table[:, 4]) > 0
      kept = {"log_weights": table[:, 7], "ess": pf.ess(table[:, 7]), "alive": finite.astype(jnp.int32),
              "num_alive": jnp.sum(finite).astype(jnp.int32)}
      metrics.update({k: jnp.where(overflow, v, metrics[k]) for k, v in kept.items()})
    return new_state, metrics

  specs = state_specs()
  sharded = jax.shard_map(local_step, mesh=mesh, in_specs=(specs, BATCH_SPEC),
                          out_specs=(specs, TRAIN_METRIC_SPECS))
  return jax.jit(sharded, donate_argnums=0)


def make_eval_step(model: nn.Module, mesh: jax.sharding.Mesh, particle_loop: str = "vmap") -> Callable:
  """``eval_step(state, batch, fused_bn=None) -> sums`` for every particle, the ensembles and the fused model.

  ``batch`` is ``{"image": [N, ...], "label": [N], "mask": [N]}`` sharded over
  ``"data"`` and seen by every particle. Returns additive sums (see
  ``metrics.classification_sums``), replicated: ``particles`` with a leading ``[P]`` axis,
  ``ensemble`` (``sum_i w_i softmax(f(theta_i, x))``), ``ensemble_uniform``
  (equal weights over finite particles) and ``fused`` (``f(sum_i w_i theta_i)``
  with ``sum_i w_i beta_i`` BatchNorm statistics); with ``fused_bn`` (replicated
  BatchNorm statistics from ``make_fused_bn_fn``) also ``fused_bn``, the fused
  parameters with those statistics.
  """

  def predict(params, shared, batch_stats, image):
    variables = {"params": sharing.merge(params, shared), "batch_stats": batch_stats}
    return jax.nn.softmax(model.apply(variables, image, train=False))

  def local_eval(state: ParticleState, batch, fused_bn):
    image, label, mask = batch["image"], batch["label"], batch["mask"]
    shared = state.shared_params
    probs = over_particles(predict, particle_loop, (0, None, 0, None))(
        state.params, shared, state.batch_stats, image)  # [L, b, C]
    w = jnp.exp(state.log_weights)
    alive = (w > 0).astype(jnp.float32)
    per_particle = jax.vmap(metrics_lib.classification_sums, in_axes=(0, None, None))(probs, label, mask)
    ensemble = correction.weighted_sum(probs, w, PARTICLE)
    uniform = correction.weighted_sum(probs, alive, PARTICLE) / lax.psum(alive.sum(), PARTICLE)
    fused_params, fused_stats = _fused(state)
    sums = {"particles": jax.tree.map(lambda x: pf.gather_all(x, PARTICLE), per_particle),
            "ensemble": metrics_lib.classification_sums(ensemble, label, mask),
            "ensemble_uniform": metrics_lib.classification_sums(uniform, label, mask),
            "fused": metrics_lib.classification_sums(predict(fused_params, shared, fused_stats, image), label, mask)}
    if fused_bn is not None:
      sums["fused_bn"] = metrics_lib.classification_sums(predict(fused_params, shared, fused_bn, image), label, mask)
    return {**lax.psum(sums, DATA), "weights": pf.gather_all(w, PARTICLE)}

  sharded = jax.jit(jax.shard_map(local_eval, mesh=mesh, in_specs=(state_specs(), EVAL_BATCH_SPEC, P()),
                                  out_specs=P()))
  return lambda state, batch, fused_bn=None: sharded(state, batch, fused_bn)


def make_fused_bn_fn(model: nn.Module, mesh: jax.sharding.Mesh, particle_loop: str = "vmap") -> Callable:
  """``fused_bn(state, batch) -> batch_stats``: the fused model's BatchNorm statistics on one train batch.

  The fused parameters ``sum_i w_i theta_i`` run in train mode on each particle's shard of
  ``batch`` (laid out and sharded as for the train step; statistics synchronised over
  ``"data"`` as in training); the per-shard means and variances are averaged over all shards.
  Averaged over a few batches, they replace ``sum_i w_i beta_i``, which does not describe the
  activations of the averaged network (as SWA re-estimates them). Returned replicated.
  """
  stats_model = model.clone(bn_momentum=0.0)  # running statistics := this batch's statistics

  def local(state: ParticleState, batch):
    fused = correction.fuse(state.params, jnp.exp(state.log_weights), PARTICLE)  # its statistics are replaced
    variables = {"params": sharing.merge(fused, state.shared_params),
                 "batch_stats": jax.tree.map(lambda x: jnp.zeros_like(x[0]), state.batch_stats)}

    def one(image):
      return stats_model.apply(variables, image, train=True, mutable=["batch_stats"])[1]["batch_stats"]

    stats = over_particles(one, particle_loop, (0,))(batch["image"])
    return lax.pmean(jax.tree.map(lambda x: jnp.mean(x, axis=0), stats), PARTICLE)

  return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(state_specs(), BATCH_SPEC), out_specs=P()))


def _fused(state: ParticleState):
  """``(sum_i w_i theta_i, sum_i w_i beta_i)`` of the per-particle parameters and BatchNorm statistics."""
  w = jnp.exp(state.log_weights)
  return correction.fuse(state.params, w, PARTICLE), correction.fuse(state.batch_stats, w, PARTICLE)


def make_fuse_fn(mesh: jax.sharding.Mesh) -> Callable:
  """``fuse(state) -> (variables, distances)``, both replicated.

  ``variables`` = ``{"params": sum_i w_i theta_i (with the shared ones),
  "batch_stats": sum_i w_i beta_i}``, ready for a plain ``model.apply``;
  ``distances`` ``[P]`` = ``||theta_i - theta_bar||`` (particle diversity).
  """

  def local(state: ParticleState):
    fused, fused_stats = _fused(state)
    sq = sum(jnp.sum(jnp.square(x - f[None]).reshape(x.shape[0], -1), axis=1)
             for x, f in zip(jax.tree.leaves(state.params), jax.tree.leaves(fused)))
    variables = {"params": sharing.merge(fused, state.shared_params), "batch_stats": fused_stats}
    return variables, pf.gather_all(jnp.sqrt(sq), PARTICLE)

  return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(state_specs(),), out_specs=(P(), P())))

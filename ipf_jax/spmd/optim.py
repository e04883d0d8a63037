"""Optimizer, learning-rate schedule and the LR scaling rule (DESIGN.md §3.4)."""

from __future__ import annotations

import functools
import hashlib
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax.training import dynamic_scale

from ipf_jax.spmd import fsdp


def lr_scale(
  rule: str, global_batch_size: int, reference_batch_size: int, devices: int = 1, num_particles: int = 1
) -> float:
  """``none``: 1; ``linear``: G / ref; ``sqrt``: sqrt(G / ref); ``seed``: sqrt(devices x P), the seed's
  ``lr = base_lr * sqrt(world_size * particle_num)`` (it ignores the batch size)."""
  ratio = global_batch_size / reference_batch_size
  return {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio), "seed": math.sqrt(devices * num_particles)}[rule]


def train_steps(config: ml_collections.ConfigDict, steps_per_epoch: int) -> tuple[int, int]:
  """``(total, warmup)`` optimizer steps: from ``num_epochs``/``warmup_epochs`` when set, else the step fields."""
  total = round(config.num_epochs * steps_per_epoch) if config.num_epochs else config.num_train_steps
  warmup = round(config.warmup_epochs * steps_per_epoch) if config.warmup_epochs else config.warmup_steps
  return max(total, 1), min(warmup, max(total - 1, 0))


def create_learning_rate_fn(config: ml_collections.ConfigDict, total_steps: int, warmup_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to ``base_lr * scale`` over ``warmup_steps``, then cosine decay to 0 at
  ``total_steps`` (one optimizer update per train step, also with gradient accumulation)."""
  peak = config.base_lr * lr_scale(
    config.lr_scaling,
    config.global_batch_size,
    config.reference_batch_size,
    config.num_devices or jax.device_count(),
    config.num_particles,
  )
  return optax.warmup_cosine_decay_schedule(0.0, peak, warmup_steps, total_steps, end_value=0.0)


def _decay_mask(params):
  """Weight decay on kernels only: not on BatchNorm scales/offsets or biases."""
  return jax.tree.map(lambda p: p.ndim > 1, params)


OPTIMIZERS = ("sgd", "adamw", "lamb", "lion", "adafactor")
ELEMENTWISE = ("sgd", "adamw", "lion")  # an update of a shard of the weights needs that shard only (config.fsdp)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
  """``optax.clip_by_global_norm`` (the same state, ``EmptyState``, and the same numbers) whose norm is over
  the particle's whole leaves when its leaves are sharded over ``"data"`` (``config.fsdp``: ``fsdp.global_norm``
  sums the shards' squares over the group)."""

  def update(updates, state, params=None):
    del params
    norm = fsdp.global_norm(updates)
    trigger = jnp.squeeze(norm < max_norm)
    return jax.tree.map(lambda t: jax.lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm), updates), state

  return optax.GradientTransformation(optax.init_empty_state, update)


def _core(config: ml_collections.ConfigDict, lr_fn: optax.Schedule) -> list[optax.GradientTransformation]:
  """``config.optimizer`` from optax, its weight decay on kernels only (``_decay_mask``)."""
  wd, mask = config.weight_decay, _decay_mask
  mu_dtype = jnp.dtype(config.mu_dtype) if config.mu_dtype else None
  name = config.optimizer
  if name == "sgd":
    sgd = optax.sgd(lr_fn, momentum=config.momentum or None, nesterov=config.nesterov and bool(config.momentum))
    return ([optax.add_decayed_weights(wd, mask=mask)] if wd else []) + [sgd]
  if name == "adamw":
    return [optax.adamw(lr_fn, config.b1, config.b2, config.eps, mu_dtype=mu_dtype, weight_decay=wd, mask=mask)]
  if name == "lamb":
    return [optax.lamb(lr_fn, config.b1, config.b2, config.eps, weight_decay=wd, mask=mask)]
  if name == "lion":
    return [optax.lion(lr_fn, config.b1, config.b2, mu_dtype=mu_dtype, weight_decay=wd, mask=mask)]
  if name == "adafactor":
    return [optax.adafactor(lr_fn, weight_decay_rate=wd or None, weight_decay_mask=mask)]
  raise ValueError(f"config.optimizer: unknown {name!r}; use one of {', '.join(OPTIMIZERS)}")


def create_optimizer(config: ml_collections.ConfigDict, lr_fn: optax.Schedule) -> optax.GradientTransformation:
  """``config.optimizer`` with the run's schedule ``lr_fn``, after optional clipping of each particle's
  direction ``d_i`` by its global norm. ``sgd`` (the default): (Nesterov) momentum with L2 weight decay on
  kernels (``wd * theta`` added to the direction before the momentum, as PyTorch's and flax's ImageNet SGD do;
  not decoupled); ``adamw``, ``lamb``, ``lion``: optax's, with decoupled weight decay on kernels;
  ``adafactor``: optax's, factored second moments.

  One particle's optimizer: the train step vmaps it over the particle axis, and its state moves with its
  particle in resampling. Gradient accumulation (``grad_accum_steps``) happens inside the train step, before
  the filter (``step.accumulate``).
  """
  clip = [clip_by_global_norm(config.grad_clip_norm)] if config.grad_clip_norm else []
  return optax.chain(*clip, *_core(config, lr_fn))  # sgd's chain as before there was a choice: checkpoints fit


# A library user's optimizer for one particle: the run's schedule -> a transformation, or a transformation.
Optimizer = Callable[[optax.Schedule], optax.GradientTransformation] | optax.GradientTransformation


def builtin_name(config: ml_collections.ConfigDict) -> str:
  """The built-in optimizer in words, e.g. ``sgd(momentum=0.9, nesterov=True, weight_decay=0.0005)``."""
  name = config.optimizer
  if name == "sgd":
    parts = [f"momentum={config.momentum}", f"nesterov={bool(config.nesterov and config.momentum)}"]
  elif name == "adafactor":
    parts = []
  else:
    parts = [f"b1={config.b1}", f"b2={config.b2}"] + ([f"eps={config.eps}"] if name != "lion" else [])
    parts += [f"mu_dtype={config.mu_dtype}"] if config.mu_dtype else []
  parts.append(f"weight_decay={config.weight_decay}")
  parts += [f"grad_clip_norm={config.grad_clip_norm}"] if config.grad_clip_norm else []
  return f"{name}({', '.join(parts)})"


def _callable_name(fn) -> str:
  if isinstance(fn, functools.partial):
    return _callable_name(fn.func)
  name = getattr(fn, "__name__", None)
  return "a custom optimizer" if not name or "<lambda>" in name else name


def state_kind(opt_state) -> str:
  """The optimizer state's kind: its optax state types in order (``EmptyState`` left out), e.g.
  ``TraceState, ScaleByScheduleState`` for SGD with momentum, ``ScaleByAdamState, ScaleByScheduleState``
  for AdamW; dicts (``multi_transform``'s inner states) in key order."""
  names = []

  def visit(node):
    if isinstance(node, tuple) and hasattr(node, "_fields"):
      if type(node).__name__ != "EmptyState":
        names.append(type(node).__name__)
      for child in node:
        visit(child)
    elif isinstance(node, (tuple, list)):
      for child in node:
        visit(child)
    elif isinstance(node, dict):
      for key in sorted(node, key=str):
        visit(node[key])

  visit(opt_state)
  return ", ".join(names) or "no state"


def optimizer_record(config: ml_collections.ConfigDict, optimizer: Optional[Optimizer], opt_state) -> dict:
  """What a checkpoint records of the optimizer that wrote it: ``name``, the ``state`` kind (``state_kind``),
  ``tree`` (a digest of the state's tree structure: two records of one kind can still differ) and
  ``builtin`` (the config's SGD)."""
  name = builtin_name(config) if optimizer is None else _callable_name(optimizer)
  tree = hashlib.sha1(str(jax.tree.structure(opt_state)).encode()).hexdigest()[:12]
  return {"name": name, "state": state_kind(opt_state), "tree": tree, "builtin": optimizer is None}


def make_optimizer(
  config: ml_collections.ConfigDict, lr_fn: optax.Schedule, optimizer: Optional[Optimizer] = None
) -> optax.GradientTransformation:
  """A library user's ``optimizer``: ``optimizer(lr_fn)`` for a function of the run's schedule (e.g.
  ``lambda lr: optax.adamw(lr, weight_decay=0.05)``), or an ``optax.GradientTransformation`` as given (its own
  schedule); else the config's (``create_optimizer``)."""
  if optimizer is None:
    return create_optimizer(config, lr_fn)
  return optimizer if isinstance(optimizer, optax.GradientTransformation) else optimizer(lr_fn)


def given(optimizer: Optional[Optimizer], tx: Optional[optax.GradientTransformation]) -> Optional[Optimizer]:
  """The one optimizer a library call was given, as ``optimizer=`` or ``tx=``."""
  if optimizer is not None and tx is not None:
    raise ValueError(
      "give the optimizer once: optimizer=... (a function of the schedule, or a transformation) or "
      "tx=... (a transformation), not both"
    )
  return tx if tx is not None else optimizer


def reported_schedule(lr_fn: optax.Schedule, optimizer: Optional[Optimizer], spec) -> Optional[optax.Schedule]:
  """The schedule the train step reports as ``lr`` (and ``jitter_lr`` scales with): the run's, unless the
  optimizer is a transformation with its own (then ``None``, where ``jitter_lr`` does not need it)."""
  own = isinstance(optimizer, optax.GradientTransformation)
  return None if own and not spec.jitter_lr else lr_fn


def create_dynamic_scale(config: ml_collections.ConfigDict) -> dynamic_scale.DynamicScale | None:
  """Dynamic loss scaling for ``dtype="float16"`` (flax's ``DynamicScale``), else ``None``.

  The loss is multiplied by ``scale`` before the backward pass so that small
  float16 gradients do not flush to zero; a step whose gradients overflow is
  skipped and ``scale`` halved, and after ``loss_scale_growth_interval`` finite
  steps it doubles. The scale never goes below 1: a particle whose gradient
  still overflows at scale 1 has diverged and is culled as in float32.
  """
  if config.dtype != "float16":
    return None
  return dynamic_scale.DynamicScale(
    growth_interval=int(config.loss_scale_growth_interval),
    fin_steps=jnp.zeros((), jnp.int32),
    scale=jnp.asarray(config.loss_scale_init, jnp.float32),
    minimum_scale=1.0,
  )

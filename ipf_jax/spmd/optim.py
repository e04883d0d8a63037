"""The optimizer's pieces that know the SPMD layout (DESIGN.md §3.4): the LR scaling rule, clipping by a particle's
global norm across its FSDP shards, weight decay's mask, float16's loss scale, and what a checkpoint records of an
optimizer. The config's choice of optimizer and schedule is read in ``ipf_jax.config.read``."""

from __future__ import annotations

import functools
import hashlib
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
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


def decay_mask(params):
  """Weight decay on kernels only: not on BatchNorm scales/offsets or biases."""
  return jax.tree.map(lambda p: p.ndim > 1, params)


OPTIMIZERS = ("sgd", "adamw", "lamb", "lion", "adafactor")
ELEMENTWISE = ("sgd", "adamw", "lion")  # an update of a shard of the weights needs that shard only (FSDP)


SHARD_DIMS = "shard_dims"  # the extra argument (optax's extra-args protocol) that tells an update its leaves' shards


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
  """``optax.clip_by_global_norm`` (the same state, ``EmptyState``, and the same numbers) whose norm is over
  the particle's whole leaves when its leaves are sharded over ``"data"``: the step passes the shards' layout as
  the extra argument ``shard_dims`` (``fsdp.dims_of``; optax's chain hands extra arguments to each transformation
  that takes them), and ``fsdp.global_norm`` sums the shards' squares over the group."""

  def update(updates, state, params=None, **extra):
    del params
    norm = fsdp.global_norm(updates, extra.get(SHARD_DIMS))
    trigger = jnp.squeeze(norm < max_norm)
    return jax.tree.map(lambda t: jax.lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm), updates), state

  return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


# A library user's optimizer for one particle: the run's schedule -> a transformation, or a transformation.
Optimizer = Callable[[optax.Schedule], optax.GradientTransformation] | optax.GradientTransformation


def callable_name(fn) -> str:
  if isinstance(fn, functools.partial):
    return callable_name(fn.func)
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


def optimizer_record(name: str, builtin: bool, opt_state) -> dict:
  """What a checkpoint records of the optimizer that wrote it: ``name`` (the built-in's in words, or a library
  user's optimizer's, ``callable_name``), the ``state`` kind (``state_kind``), ``tree`` (a digest of the state's
  tree structure: two records of one kind can still differ) and ``builtin``."""
  tree = hashlib.sha1(str(jax.tree.structure(opt_state)).encode()).hexdigest()[:12]
  return {"name": name, "state": state_kind(opt_state), "tree": tree, "builtin": builtin}


def resolve(
  builtin: Callable[[optax.Schedule], optax.GradientTransformation],
  lr_fn: optax.Schedule,
  optimizer: Optional[Optimizer] = None,
) -> optax.GradientTransformation:
  """A library user's ``optimizer``: ``optimizer(lr_fn)`` for a function of the run's schedule (e.g.
  ``lambda lr: optax.adamw(lr, weight_decay=0.05)``), or an ``optax.GradientTransformation`` as given (its own
  schedule); else ``builtin(lr_fn)`` (the config's, ``ipf_jax.config.read.builtin_optimizer``)."""
  if optimizer is None:
    return builtin(lr_fn)
  return optimizer if isinstance(optimizer, optax.GradientTransformation) else optimizer(lr_fn)


def scaled(tx: optax.GradientTransformation, factor: float) -> optax.GradientTransformation:
  """``tx`` with its updates multiplied by ``factor``, its state unchanged: for a transformation that brings its own
  schedule, the nearest to its learning rate times ``factor`` (exact where the update is proportional to the rate
  and no state is kept after it: SGD, Adam, AdamW; not for adafactor's weight decay or LARS's momentum, which
  come after the rate). Extra arguments (``SHARD_DIMS``) are handed on."""
  if factor == 1:
    return tx
  inner = optax.with_extra_args_support(tx)

  def update(updates, state, params=None, **extra):
    updates, state = inner.update(updates, state, params, **extra)
    return jax.tree.map(lambda u: factor * u, updates), state

  return optax.GradientTransformationExtraArgs(tx.init, update)


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


def create_dynamic_scale(
  dtype: str, growth_interval: int = 2000, init_scale: float = 65536.0
) -> dynamic_scale.DynamicScale | None:
  """Dynamic loss scaling for ``dtype="float16"`` (flax's ``DynamicScale``), else ``None``.

  The loss is multiplied by ``scale`` before the backward pass so that small
  float16 gradients do not flush to zero; a step whose gradients overflow is
  skipped and ``scale`` halved, and after ``growth_interval`` finite
  steps it doubles. The scale never goes below 1: a particle whose gradient
  still overflows at scale 1 has diverged and is culled as in float32.
  """
  if dtype != "float16":
    return None
  return dynamic_scale.DynamicScale(
    growth_interval=int(growth_interval),
    fin_steps=jnp.zeros((), jnp.int32),
    scale=jnp.asarray(init_scale, jnp.float32),
    minimum_scale=1.0,
  )

"""One builder of a run's pieces from a config and a task: the trainer, the tests and the benchmarks share it.

  parts = build(config, task, example_batch)
  state = parts.init_state()
  state, metrics = parts.train_step(state, device_batch)

``zoo_task(config, num_classes)`` is the classification task of the model zoo
(``config.model``, label smoothing, BatchNorm synchronised over ``"data"``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

import jax
import ml_collections
import optax

from ipf_jax.config import sync as sync_lib
from ipf_jax.config import read, validation
from ipf_jax.population import exchange as exchange_lib
from ipf_jax.population import outer as outer_lib
from ipf_jax.spmd import eval_step, fusion, optim, outer_step, pretrained
from ipf_jax.spmd import mesh as mesh_lib
from ipf_jax.spmd import state as state_lib
from ipf_jax.spmd import step as step_lib
from ipf_jax.spmd.spec import OuterSpec, ParticleSpec
from ipf_jax.spmd.task import Task, classification


@dataclasses.dataclass
class Parts:
  """Everything a run of ``config`` on ``task`` needs, built once (nothing is compiled yet)."""

  config: ml_collections.ConfigDict
  task: Task
  mesh: jax.sharding.Mesh
  spec: ParticleSpec
  total_steps: int
  lr_fn: optax.Schedule
  tx: optax.GradientTransformation
  abstract_state: Any  # ShapeDtypeStruct leaves with their NamedShardings (for restoring)
  init_state: Callable[[], Any]
  train_step: Callable
  eval_step: Callable
  fuse: Callable
  diversity: Callable  # state -> [P] distances to the fused parameters (fuse's second output alone)
  fused_bn_fn: Callable
  outer: Optional[OuterSpec] = None  # the outer loop's settings (DESIGN.md §3b); None: the per-step filter
  lr_factor: float = 1.0  # the learning rate is the schedule's times this (config.rewind_lr_factor after rewinds)
  rebuild: Optional[Callable[[float], Callable]] = None  # lr_factor -> the train step at that factor

  def step_at(self, step: int) -> Callable:
    """The program that trains step ``step`` (the outer loop has two: local and sync; the host picks)."""
    return self.train_step.at(step) if self.outer is not None else self.train_step

  def with_lr_factor(self, factor: float) -> "Parts":
    """These parts with the train step recompiled for the learning rate times ``factor`` (``_train_step``: the
    optimizer rebuilt on the scaled schedule, its state's layout unchanged, so a checkpoint restores across
    factors)."""
    if factor == self.lr_factor:
      return self
    if self.rebuild is None:
      raise ValueError("config.rewind_lr_factor: these Parts were not made by build(), which can recompile the step")
    return dataclasses.replace(self, train_step=self.rebuild(factor), lr_factor=factor)


def zoo_task(config: ml_collections.ConfigDict, num_classes: int) -> Task:
  """Classification with the zoo model ``config.model`` (SyncBN over ``"data"``), ``label_smoothing`` and
  ``mixup``, per particle with their ``_spread``."""
  from ipf_jax import models

  spec = read.model_spec(config, num_classes)
  return classification(
    models.create_model(spec, bn_axis_name=mesh_lib.DATA),
    label_smoothing=config.label_smoothing,
    rngs=spec.rngs,
    mixup=config.mixup,
    num_classes=num_classes,
    label_smoothing_spread=config.label_smoothing_spread,
    mixup_spread=config.mixup_spread,
  )


def mesh_for(config: ml_collections.ConfigDict, devices: Optional[Sequence[jax.Device]] = None) -> jax.sharding.Mesh:
  """The run's ``("particle", "data")`` mesh: with ``devices`` None, the CPU split made first
  (``validation.setup_devices``) and the first ``config.num_devices`` devices (0: all) taken; the config checked
  against them (``validation.validate``). The one place a run sets up its devices and checks its config."""
  if devices is None:
    validation.setup_devices(config)
    available = jax.device_count()  # all of them: an error's suggested device counts go up to it
    devices = jax.devices()[: config.num_devices or available]
  else:
    available = len(devices)
  return mesh_lib.make_mesh(config.num_particles, list(devices), validation.validate(config, available)[0])


def build(
  config: ml_collections.ConfigDict,
  task: Task,
  example: dict,
  steps_per_epoch: int = 1,
  devices: Optional[Sequence[jax.Device]] = None,
  spec: Optional[ParticleSpec] = None,
  optimizer: Optional[optim.Optimizer] = None,
  exchange: Optional[exchange_lib.Exchange] = None,
  tx: Optional[optax.GradientTransformation] = None,
  mesh: Optional[jax.sharding.Mesh] = None,
) -> Parts:
  """The mesh, particle spec, schedule, optimizer, state initialiser and jitted steps of a run.

  Args:
    example: a batch dict (arrays or ``ShapeDtypeStruct``s) with the fields the model reads.
    steps_per_epoch: for ``num_epochs`` / ``warmup_epochs``.
    devices: default ``jax.devices()[:config.num_devices or all]``.
    spec: override of ``validation.particle_spec(config)`` (benchmarks isolate parts of the step).
    optimizer: one particle's optimizer as a function of the run's schedule, ``lr_fn ->
      optax.GradientTransformation`` (e.g. ``lambda lr: optax.adamw(lr, weight_decay=0.05)``), or any
      ``optax.GradientTransformation`` with its own schedule; default the config's (``config.optimizer``,
      ``read.builtin_optimizer``).
    exchange: how resampled particles move (``population.exchange.Exchange``, e.g. ``functools.partial(
      population.exchange.exchange_rounds, bucket_bytes=65536)``); default the config's ``resample_exchange``.
    tx: the same as ``optimizer=tx``, for a transformation. A transformation brings its own schedule, so the
      step's ``lr`` metric (the config's schedule) is left out unless ``jitter_lr`` needs the schedule.
    mesh: ``mesh_for(config)``'s, made already (the trainer's: its devices set up and the config checked once;
      ``devices`` is then not read); default made here.
  """
  optimizer = optim.given(optimizer, tx)
  mesh = mesh if mesh is not None else mesh_for(config, devices)
  spec = spec or validation.particle_spec(config)
  _check_init(config, task, spec)
  total, warmup = read.train_steps(config, steps_per_epoch)
  lr_fn, outer = read.learning_rate_fn(config, total, warmup), sync_lib.outer_spec(config)
  tx = read.optimizer(config, lr_fn, optimizer)
  abstract, init = read.state_init(config, spec, task, tx, example, mesh, outer)
  if config.init_from:
    init = functools.partial(init, _start(config, task, example))
  schedule = (total, warmup, lr_fn)
  rebuild = functools.partial(_train_step, task, config, tx, spec, outer, mesh, schedule, optimizer, exchange)
  return Parts(
    config=config,
    task=task,
    mesh=mesh,
    spec=spec,
    total_steps=total,
    lr_fn=lr_fn,
    tx=tx,
    abstract_state=abstract,
    init_state=init,
    train_step=rebuild(1.0),
    eval_step=eval_step.make_eval_step(task, mesh, spec.particle_loop),
    fuse=fusion.make_fuse_fn(mesh),
    diversity=fusion.make_diversity_fn(mesh),
    fused_bn_fn=fusion.make_fused_bn_fn(task, mesh, spec.particle_loop),
    outer=outer,
    rebuild=rebuild,
  )


def _train_step(task, config, tx, spec, outer, mesh, schedule, optimizer, exchange, lr_factor: float = 1.0) -> Callable:
  """The per-step filter's jitted step, or the outer loop's (``outer``: its syncs from the run's ``schedule``,
  ``(total, warmup, lr_fn)``, unscaled). ``lr_factor`` (``config.rewind_lr_factor`` after rewinds): the optimizer
  built on the schedule times it (a transformation with its own schedule: its updates scaled, ``optim.scaled``);
  the state's layout is the same at every factor."""
  total, warmup, lr_fn = schedule
  if lr_factor != 1 and isinstance(optimizer, optax.GradientTransformation):  # ``tx``: the run's, from ``build``
    tx = optim.scaled(optimizer, lr_factor)
  elif lr_factor != 1:
    tx = read.optimizer(config, _times(lr_fn, lr_factor), optimizer)
  reported = optim.reported_schedule(lr_fn, optimizer, spec)
  reported = reported if reported is None or lr_factor == 1 else _times(reported, lr_factor)
  if outer is None:
    return step_lib.make_train_step(task, tx, spec, mesh, reported, exchange, step_lib.preset(spec))
  cpu = jax.local_devices(backend="cpu")[0]  # the schedule on one backend, every host (its own CPU) and resume

  def lr_on_cpu(k: int) -> float:
    with jax.default_device(cpu):
      return float(lr_fn(k))

  syncs = outer_lib.sync_steps(
    outer.sync, total, outer.sync_every, lr_on_cpu, warmup, outer.sync_qsr_alpha, outer.sync_swap_fraction
  )
  return outer_step.make_outer_train_step(task, tx, spec, outer, mesh, syncs, reported, exchange)


def _times(schedule: optax.Schedule, factor: float) -> optax.Schedule:
  return lambda step: factor * schedule(step)


def _check_init(config: ml_collections.ConfigDict, task: Task, spec: ParticleSpec) -> None:
  """An ``nnx.Module`` instance gives every particle its values: it cannot start them apart."""
  if getattr(task.model, "shared_init_only", False) and not spec.shared_init:
    raise validation.ConfigError(
      "init",
      f"mode={config.mode!r} with init={config.init!r} starts each particle from its own init, but the "
      "task's model is an nnx.Module instance, which gives every particle its values. Pass a constructor "
      "instead, Task(model=lambda rngs: MyModel(..., rngs=rngs)), or set config.init='shared'",
    )


def _start(config: ml_collections.ConfigDict, task: Task, example: dict) -> dict:
  """``config.init_from``'s values for ``task``'s model, checked against its shapes (nothing compiled)."""
  return pretrained.for_model(
    config.init_from, config.init_reinit, state_lib.variables_shapes(task, example), config.init_particle
  )


def state_shapes(
  config: ml_collections.ConfigDict,
  task: Task,
  example: dict,
  steps_per_epoch: int = 1,
  optimizer: Optional[optim.Optimizer] = None,
):
  """The shapes and dtypes of the state ``config`` builds for ``task`` (no mesh, nothing compiled)."""
  total, warmup = read.train_steps(config, steps_per_epoch)
  tx = read.optimizer(config, read.learning_rate_fn(config, total, warmup), optimizer)
  return read.state_shapes(config, validation.particle_spec(config), task, tx, example, sync_lib.outer_spec(config))

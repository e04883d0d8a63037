"""The config, read: the one place where a config's fields become the typed arguments of the layers below
(``spmd``, ``data``, ``models``), which never take a config (tests/test_layers.py). The optimizer (a function of
the run's schedule), the schedule, the model's ``ModelSpec``, the dataset and its shifted and OOD sets, and the
state initialiser's arguments."""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import ml_collections
import optax

from ipf_jax import models
from ipf_jax.data import DATASETS, TFDS_DATASETS, shifts
from ipf_jax.errors import ConfigError
from ipf_jax.population import outer as outer_lib
from ipf_jax.spmd import optim
from ipf_jax.spmd import state as state_lib
from ipf_jax.spmd.spec import OuterSpec, ParticleSpec

Config = ml_collections.ConfigDict


def train_steps(config: Config, steps_per_epoch: int) -> tuple[int, int]:
  """``(total, warmup)`` optimizer steps: from ``num_epochs``/``warmup_epochs`` when set, else the step fields."""
  total = round(config.num_epochs * steps_per_epoch) if config.num_epochs else config.num_train_steps
  warmup = round(config.warmup_epochs * steps_per_epoch) if config.warmup_epochs else config.warmup_steps
  return max(total, 1), min(warmup, max(total - 1, 0))


def peak_learning_rate(config: Config) -> float:
  """``base_lr`` times the scaling rule's factor (``optim.lr_scale``)."""
  devices = config.num_devices or jax.device_count()
  scale = optim.lr_scale(
    config.lr_scaling, config.global_batch_size, config.reference_batch_size, devices, config.num_particles
  )
  return config.base_lr * scale


def learning_rate_fn(config: Config, total_steps: int, warmup_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to the peak rate (``peak_learning_rate``) over ``warmup_steps``, then cosine decay to
  0 at ``total_steps`` (one optimizer update per train step, also with gradient accumulation)."""
  return optax.warmup_cosine_decay_schedule(0.0, peak_learning_rate(config), warmup_steps, total_steps, 0.0)


def _core(config: Config, lr_fn: optax.Schedule) -> list[optax.GradientTransformation]:
  """``config.optimizer`` from optax, its weight decay on kernels only (``optim.decay_mask``)."""
  wd, mask = config.weight_decay, optim.decay_mask
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
  raise ConfigError("optimizer", f"unknown {name!r}; use one of {', '.join(optim.OPTIMIZERS)}")


def builtin_optimizer(config: Config) -> Callable[[optax.Schedule], optax.GradientTransformation]:
  """``config.optimizer`` as a function of the run's schedule, after optional clipping of each particle's
  direction ``d_i`` by its global norm. ``sgd`` (the default): (Nesterov) momentum with L2 weight decay on
  kernels (``wd * theta`` added to the direction before the momentum, as PyTorch's and flax's ImageNet SGD do;
  not decoupled); ``adamw``, ``lamb``, ``lion``: optax's, with decoupled weight decay on kernels;
  ``adafactor``: optax's, factored second moments.

  One particle's optimizer: the train step vmaps it over the particle axis, and its state moves with its
  particle in resampling. Gradient accumulation (``grad_accum_steps``) happens inside the train step, before
  the filter (``step.accumulate``).
  """

  def make(lr_fn: optax.Schedule) -> optax.GradientTransformation:
    clip = [optim.clip_by_global_norm(config.grad_clip_norm)] if config.grad_clip_norm else []
    return optax.chain(*clip, *_core(config, lr_fn))  # sgd's chain as before there was a choice: checkpoints fit

  return make


def optimizer(
  config: Config, lr_fn: optax.Schedule, given: Optional[optim.Optimizer] = None
) -> optax.GradientTransformation:
  """The run's optimizer: a library user's (``optim.resolve``), else the config's."""
  return optim.resolve(builtin_optimizer(config), lr_fn, given)


def builtin_name(config: Config) -> str:
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


def optimizer_record(config: Config, given: Optional[optim.Optimizer], opt_state) -> dict:
  """``optim.optimizer_record`` of the run's optimizer: the config's (``builtin_name``) or the user's."""
  name = builtin_name(config) if given is None else optim.callable_name(given)
  return optim.optimizer_record(name, given is None, opt_state)


def dynamic_scale(config: Config):
  """float16's initial loss scale (``optim.create_dynamic_scale``), else ``None``."""
  return optim.create_dynamic_scale(config.dtype, config.loss_scale_growth_interval, config.loss_scale_init)


def model_spec(config: Config, num_classes: int) -> models.ModelSpec:
  """The zoo model ``config.model`` names: each of ``ModelSpec``'s fields is the config field of its name."""
  names = [f.name for f in dataclasses.fields(models.ModelSpec) if f.name != "num_classes"]
  return models.ModelSpec.from_fields({**{k: config[k] for k in names}, "num_classes": num_classes})


def model(config: Config, num_classes: int, bn_axis_name: Optional[str] = None):
  """The Flax module ``config.model`` names (``models.create_model``)."""
  return models.create_model(model_spec(config, num_classes), bn_axis_name)


def dataset(config: Config):
  """The dataset ``config.dataset`` names. Every dataset (and ``ArrayDataset``, ``Data`` for your own)
  has ``name``, ``num_classes``, ``train_size``, ``test_size``, ``example`` (one example per field),
  ``process_local``, ``steps_per_epoch(G)``, ``train_batches(start_step, G, seed)`` and
  ``eval_batches(n)``."""
  if config.dataset == "digits":
    from ipf_jax.data import digits

    data = digits.load()
    if config.calibration_fraction:  # before the label noise: the temperature is fitted on clean labels
      data = data.holdout(config.calibration_fraction)
    if config.train_fraction < 1 or config.label_noise > 0:
      data = data.harder(config.train_fraction, config.label_noise)
    return data
  if config.dataset in TFDS_DATASETS:
    from ipf_jax.data import tfds_input  # imports TensorFlow: only for TFDS datasets

    data_dir = os.path.expanduser(config.data_dir) if config.data_dir else None  # "~/..." in a config file
    return tfds_input.TFDSDataset(
      config.dataset,
      data_dir,
      config.image_size,
      shuffle_buffer=config.shuffle_buffer,
      small_images=config.dataset != "imagenet2012",
      randaugment=(config.randaugment_layers, config.randaugment_magnitude),
    )
  raise ConfigError("dataset", f"unknown dataset {config.dataset!r}; use one of {', '.join(DATASETS)}")


def eval_sets(config: Config, data) -> dict:
  """The shifted sets ``config.eval_shifts`` names (``shifts.eval_sets``)."""
  names = shifts.names(config.eval_shifts, config.dataset)
  return shifts.eval_sets(names, config.dataset, data, config.shift_examples)


def ood_sets(config: Config, data) -> dict:
  """The OOD sets ``config.ood_dataset`` names (``shifts.ood_sets``)."""
  return shifts.ood_sets(shifts.ood_names(config.ood_dataset), config.dataset, data, config.shift_examples)


def _state_args(config: Config, spec: ParticleSpec, outer: Optional[OuterSpec]) -> dict:
  """The ``train_state_init`` arguments that the config, the particle spec and the outer loop decide."""
  return dict(
    shared_init=spec.shared_init,
    shared_pattern=config.shared_params,
    compress=spec.compress_correction,
    dynamic_scale=dynamic_scale(config),
    outer_tx=None if outer is None else outer_lib.outer_optimizer(outer.outer_lr, outer.outer_momentum),
  )


def state_init(config: Config, spec: ParticleSpec, task, tx, example: dict, mesh, outer: Optional[OuterSpec]):
  """``state.train_state_init`` with everything the config and the particle spec decide: seed, init,
  shared parameters, compression residuals, float16's loss scale, FSDP's threshold and the outer loop's anchor."""
  return state_lib.train_state_init(
    jax.random.PRNGKey(config.seed),
    task,
    tx,
    example,
    spec.num_particles,
    mesh,
    **_state_args(config, spec, outer),
    fsdp_min_bytes=config.fsdp_min_size_mb * 2**20 if config.fsdp else None,
  )


def state_shapes(config: Config, spec: ParticleSpec, task, tx, example: dict, outer: Optional[OuterSpec]):
  """Shapes and dtypes (``ShapeDtypeStruct`` leaves) of the state ``config`` builds; compiles nothing."""
  return state_lib.train_state_shapes(task, tx, example, spec.num_particles, **_state_args(config, spec, outer))

"""Config validation and the static particle settings derived from it.

Every check runs before anything is compiled and raises one ``ConfigError``
that names the field and a value that would work.
"""

from __future__ import annotations

import math
import re
from typing import Optional

import jax
import ml_collections

from ipf_jax import models
from ipf_jax.config import defaults, sync
from ipf_jax.errors import ConfigError  # noqa: F401 - raised here, and re-exported for callers
from ipf_jax.population import exchange
from ipf_jax.population import particle_filter as pf
from ipf_jax.spmd import mesh as mesh_lib
from ipf_jax.spmd.optim import ELEMENTWISE, OPTIMIZERS
from ipf_jax.spmd.spec import ParticleSpec

MODES = ("ddp", "ensemble", "ipf")
LR_SCALING = ("none", "linear", "sqrt", "seed")
WEIGH_ON = ("own", "common")
DTYPES = ("float32", "bfloat16", "float16")
INITS = ("auto", "shared", "independent")
PARTICLE_LOOPS = ("auto", "vmap", "map", "unroll")
# particle_loop="auto" by backend, measured (BENCHMARKS.md): on an H200 vmapped convolutions (grouped
# convolutions) ran ResNet-50 at 0.07x DDP's images/s, unroll at 0.92x, map at 0.89x (least memory); on
# CPUs vmap is fastest. TPUs: not measured, vmap.
BEST_PARTICLE_LOOP = {"gpu": "unroll", "cuda": "unroll", "rocm": "unroll"}


def resolve_particle_loop(loop: str, backend: Optional[str] = None) -> str:
  """``auto``: the measured best for ``backend`` (default: JAX's); otherwise ``loop``."""
  if loop != "auto":
    return loop
  return BEST_PARTICLE_LOOP.get(backend or jax.default_backend(), "vmap")


EXCHANGES = ("auto",) + exchange.EXCHANGES


def setup_devices(config: ml_collections.ConfigDict) -> None:
  """Splits a CPU-only host into ``config.num_cpu_devices`` devices (0: leave JAX's count).

  Called in two places, before anything starts JAX's backend: ``builder.mesh_for`` (every run's first step:
  ``train_and_evaluate``, ``evaluate_checkpoint``, ``check_run``, ``build``; the compare command's checks) and
  ``train.py`` (before ``jax.distributed`` starts the backend; a repeat with the same count does nothing).
  If the caller already started it (any ``jax.devices()`` or JAX operation) with another number of CPU
  devices, the split can no longer be made: ``ConfigError``, rather than a run on devices the config did
  not ask for.
  """
  n = config.num_cpu_devices
  if not n:
    return
  try:
    jax.config.update("jax_num_cpu_devices", n)
    return
  except RuntimeError:  # JAX's backend is running already (set otherwise: XLA_FLAGS, JAX's default, ...)
    pass
  if jax.default_backend() != "cpu":
    return  # the CPU split concerns CPU-only hosts; accelerators are used as they are
  have = len(jax.local_devices(backend="cpu"))
  if have == n:
    return
  raise ConfigError(
    "num_cpu_devices",
    f"asks for {n} CPU devices, but JAX's backend was started before the run "
    f"with {have}, and the count can only be set before JAX's first operation. Set config."
    f"num_cpu_devices={have} (or 0: use what is there), or start the run before any other JAX "
    "call (jax.devices(), an array op, building an nnx.Module instance: pass a constructor "
    'instead), or set jax.config.update("jax_num_cpu_devices", '
    f"{n}) right after `import jax`.",
  )


def particle_spec(config: ml_collections.ConfigDict) -> ParticleSpec:
  """The effective particle settings: ``ensemble`` and ``ddp`` switch weights,
  correction and resampling off; ``ipf`` uses the configured values."""
  shared = config.init == "shared" or (config.init == "auto" and config.mode != "ensemble")
  common = dict(
    num_particles=config.num_particles,
    shared_init=shared,
    particle_loop=resolve_particle_loop(config.particle_loop),
    grad_accum_steps=int(config.grad_accum_steps),
    fsdp_gather=config.fsdp_gather,
  )
  if config.mode != "ipf" or config.num_particles == 1:
    return ParticleSpec(**common)
  return ParticleSpec(
    **common,
    resampling=True,
    temperature=float(config.temperature),
    forgetting=float(config.forgetting),
    correction=float(config.correction),
    ess_threshold=float(config.ess_threshold),
    resample_every=int(config.resample_every),
    jitter=float(config.jitter),
    jitter_lr=float(config.jitter_lr),
    compress_correction=bool(config.compress_correction) and config.correction > 0,
    elastic_pull=float(config.elastic_pull),
    elastic_pull_every=int(config.elastic_pull_every),
    resample_exchange=config.resample_exchange,
    resample_placement=config.resample_placement,
    ess_target=float(config.ess_target),
    weigh_on=config.weigh_on,
    common_examples=int(config.common_examples),
    islands=int(config.islands),
  )


def _check(cond: bool, field: str, message: str):
  if not cond:
    raise ConfigError(field, message)


TRACKER_PACKAGES = defaults.TRACKERS


def _validate_rewind(config) -> None:
  """``config.rewind`` goes back to checkpoints: it needs them, and a spike rule that can be met."""
  factor = config.rewind_lr_factor
  _check(0 < factor <= 1, "rewind_lr_factor", f"{factor} must be in (0, 1]: 1 keeps the rate, 0.5 halves it at each")
  if not config.rewind:
    return
  _check(
    config.checkpoint_every_steps > 0,
    "rewind",
    f"goes back to the newest checkpoint, but checkpoint_every_steps={config.checkpoint_every_steps} writes none "
    "during the run; set checkpoint_every_steps > 0 (e.g. 100) or rewind=False",
  )
  _check(config.rewind_window >= 1, "rewind_window", f"{config.rewind_window} must be at least 1 step (e.g. 20)")
  _check(
    config.rewind_loss_factor > 1,
    "rewind_loss_factor",
    f"{config.rewind_loss_factor} must be above 1: the loss's average is compared with factor x its lowest (e.g. 2)",
  )
  _check(config.rewind_max >= 0, "rewind_max", f"{config.rewind_max} must be 0 or more")
  drop, every = config.rewind_accuracy_drop, config.eval_every_steps
  _check(drop >= 0, "rewind_accuracy_drop", f"{drop} must be 0 (off) or a drop in points, e.g. 5")
  _check(
    not drop or every > 0,
    "rewind_accuracy_drop",
    "compares the periodic evaluation's accuracy with the run's best, but eval_every_steps=0 evaluates only at "
    "the end; set eval_every_steps > 0 or rewind_accuracy_drop=0",
  )
  _check(
    not drop or config.checkpoint_every_steps % max(every, 1) == 0,
    "rewind_accuracy_drop",
    f"judges each checkpoint by the evaluation before it, but checkpoint_every_steps="
    f"{config.checkpoint_every_steps} saves between evaluations (eval_every_steps={every}); set "
    f"checkpoint_every_steps to a multiple of {every}",
  )


def _check_trackers(config) -> None:
  import importlib.util

  names = [t.strip() for t in str(config.trackers).split(",") if t.strip()]
  unknown = [t for t in names if t not in TRACKER_PACKAGES]
  _check(not unknown, "trackers", f"unknown {unknown}; use a comma list of {', '.join(TRACKER_PACKAGES)}")
  for name in names:
    package = TRACKER_PACKAGES[name]
    _check(
      package is None or importlib.util.find_spec(package) is not None,
      "trackers",
      f"{name!r} needs the {package} package: pip install 'ipf-jax[{name}]' (or pip install {package}), or leave "
      f"{name} out",
    )


def _check_choice(config, field, choices):
  value = config[field]
  _check(value in choices, field, f"unknown value {value!r}; use one of {', '.join(choices)}")


def _validate_papa(config: ml_collections.ConfigDict) -> None:
  """Per-particle regularisation (PAPA): the spreads' ranges, and where they can work."""
  _check(
    config.label_smoothing_spread >= 0 and config.label_smoothing + config.label_smoothing_spread < 1,
    "label_smoothing_spread",
    f"must be >= 0 with label_smoothing + it < 1 (the last particle's smoothing), got {config.label_smoothing_spread} "
    f"with label_smoothing={config.label_smoothing}",
  )
  _check(config.mixup_spread >= 0, "mixup_spread", f"must be >= 0 (0 = off), got {config.mixup_spread}")
  spread = "label_smoothing_spread" if config.label_smoothing_spread else "mixup_spread" if config.mixup_spread else ""
  _check(
    not spread or config.num_particles > 1,
    spread,
    "spreads strengths over the particles; with num_particles=1 there is one: set label_smoothing or mixup instead",
  )
  _check(
    not spread
    or config.mode != "ipf"
    or sync.resolve(config) != "step"
    or config.weigh_on != "own"
    or config.temperature == 0,
    spread,
    "with the per-step filter weighing each particle on its own batch (sync='step', weigh_on='own', "
    f"temperature={config.temperature}) the weights come from each particle's regularised loss, and the most "
    "regularised always lose; use weigh_on='common' (the plain loss on the same examples), sync='qsr' (weighed at "
    "syncs on the plain loss) or temperature=0",
  )


def validate(config: ml_collections.ConfigDict, available_devices: int) -> tuple[int, int]:
  """Checks ``config`` against itself and the ``available_devices``: its numbers, then the algorithm's
  fields, the model's and optimizer's, the run's (steps, checkpoints, data), and last the mesh and batch.

  Returns:
    The mesh shape ``(Dp, Dd)`` the run will use.
  Raises:
    ConfigError: naming the first field that cannot work.
  """
  _validate_numbers(config)
  validate_algorithm(config)
  sync.validate_sync(config)
  _check_trackers(config)
  _validate_rewind(config)
  _validate_model(config)
  _validate_papa(config)
  _validate_run(config)
  _validate_fsdp(config)
  return _validate_mesh(config, available_devices)


def _validate_fsdp(config: ml_collections.ConfigDict) -> None:
  """``fsdp`` with what updates a shard of a particle's weights from that shard alone."""
  _check(
    config.fsdp_min_size_mb >= 0,
    "fsdp_min_size_mb",
    f"must be >= 0 MiB (0: shard every leaf that the data devices divide; default 1), got {config.fsdp_min_size_mb}",
  )
  _check_choice(config, "fsdp_gather", ("particle", "block"))
  _check(
    config.fsdp or config.fsdp_gather == "particle",
    "fsdp_gather",
    f"={config.fsdp_gather!r} chooses how a sharded particle is gathered, and fsdp=False shards none; set "
    "fsdp=True or leave fsdp_gather='particle'",
  )
  if not config.fsdp:
    return
  _check(
    config.fsdp_gather == "particle" or config.remat or config.model not in models.BLOCKED,
    "fsdp_gather",
    f"='block' gathers each block of {config.model} as it runs, which holds less only when the blocks are "
    "recomputed in the backward pass; set remat=True or fsdp_gather='particle'",
  )
  _check(
    config.optimizer in ELEMENTWISE,
    "fsdp",
    f"shards each leaf of a particle, and optimizer={config.optimizer!r} needs whole leaves (lamb: each "
    f"layer's trust ratio; adafactor: factored moments); use optimizer in {', '.join(ELEMENTWISE)} or fsdp=False",
  )
  _check(
    config.dtype != "float16",
    "fsdp",
    "with dtype='float16' is not supported (each device would judge an overflow on its own shard); use "
    "dtype='bfloat16' or fsdp=False",
  )
  _check(
    not config.compress_correction,
    "fsdp",
    "with compress_correction=True is not supported (its int8 blocks are cut from the whole particle); set "
    "compress_correction=False or fsdp=False",
  )


def _validate_numbers(config: ml_collections.ConfigDict) -> None:
  """Every float finite; the seed a 32-bit integer; every choice one of its values."""
  for field, value in config.items():
    if isinstance(value, float):
      _check(math.isfinite(value), field, f"must be a finite number, got {value}")
  seed = config.seed
  _check(isinstance(seed, int) and 0 <= seed < 2**32, "seed", f"must be an integer in [0, 2**32), got {seed!r}")
  for field, choices in (
    ("mode", MODES),
    ("lr_scaling", LR_SCALING),
    ("dtype", DTYPES),
    ("init", INITS),
    ("particle_loop", PARTICLE_LOOPS),
    ("resample_exchange", EXCHANGES),
    ("resample_placement", tuple(pf.PLACEMENTS)),
    ("weigh_on", WEIGH_ON),
  ):
    _check_choice(config, field, choices)


def _validate_init(config: ml_collections.ConfigDict) -> None:
  """Where the population starts: ``init_from``, ``init_particle``, ``init_reinit`` (DESIGN.md §8)."""
  _check(
    isinstance(config.init_particle, int) and config.init_particle >= -1,
    "init_particle",
    f"must be -1 (the fused model) or a particle's index, got {config.init_particle!r}",
  )
  _check(
    config.init_particle == -1 or bool(config.init_from),
    "init_particle",
    f"={config.init_particle} needs config.init_from, the workdir of the run whose particle to start from",
  )
  try:
    re.compile(config.init_reinit)
  except re.error as e:
    raise ConfigError("init_reinit", f"is not a valid regular expression ({e}); e.g. '^head/'") from None


def validate_algorithm(config: ml_collections.ConfigDict) -> None:
  """The particle filter's fields (docs/DESIGN.md §3): the population, weights, correction, resampling."""
  _validate_init(config)
  try:
    re.compile(config.shared_params)
  except re.error as e:
    raise ConfigError(
      "shared_params", f"is not a valid regular expression ({e}); e.g. '^(conv_init|bn_init)'"
    ) from None
  p = config.num_particles
  _check(isinstance(p, int) and p >= 1, "num_particles", f"must be an integer >= 1, got {p!r}")
  if config.mode == "ddp":
    _check(
      p == 1,
      "num_particles",
      f"mode='ddp' trains one model, got num_particles={p}; set num_particles=1 "
      "or use mode='ensemble' or mode='ipf' for a population",
    )
  _check(config.temperature >= 0, "temperature", f"must be >= 0, got {config.temperature}")
  _check(0 <= config.forgetting <= 1, "forgetting", f"must be in [0, 1], got {config.forgetting}")
  _check(
    0 <= config.ess_target < 1, "ess_target", f"must be in [0, 1) (a fraction of P; 0 = off), got {config.ess_target}"
  )
  _check(config.jitter_lr >= 0, "jitter_lr", f"must be >= 0, got {config.jitter_lr}")
  _check(
    isinstance(config.common_examples, int) and config.common_examples >= 1,
    "common_examples",
    f"must be an integer >= 1, got {config.common_examples!r}",
  )
  islands = config.islands
  _check(
    isinstance(islands, int) and islands >= 1 and p % islands == 0,
    "islands",
    f"must be an integer >= 1 that divides num_particles={p}, got {islands!r}",
  )
  _check(0 <= config.correction <= 1, "correction", f"must be in [0, 1], got {config.correction}")
  _check(0 <= config.elastic_pull <= 1, "elastic_pull", f"must be in [0, 1], got {config.elastic_pull}")
  every = config.elastic_pull_every
  _check(isinstance(every, int) and every >= 1, "elastic_pull_every", f"must be an integer >= 1, got {every!r}")
  _check(0 <= config.ess_threshold <= 1, "ess_threshold", f"must be in [0, 1], got {config.ess_threshold}")
  _check(
    config.resample_every >= 0, "resample_every", f"must be >= 0 (0 = never on schedule), got {config.resample_every}"
  )
  _check(config.jitter >= 0, "jitter", f"must be >= 0, got {config.jitter}")
  bn_batches = config.fused_bn_batches
  _check(
    isinstance(bn_batches, int) and bn_batches >= 0,
    "fused_bn_batches",
    f"must be an integer >= 0 (0 = weighted average of the particles' statistics), got {bn_batches!r}",
  )


def _validate_model(config: ml_collections.ConfigDict) -> None:
  """The model zoo's, the loss's and the optimizer's fields."""
  _check(
    len(config.cnn_features) >= 1 and all(isinstance(f, int) and f >= 1 for f in config.cnn_features),
    "cnn_features",
    f"must be a non-empty list of positive channel counts, got {config.cnn_features!r}",
  )
  _check(0 <= config.bn_momentum < 1, "bn_momentum", f"must be in [0, 1), got {config.bn_momentum}")
  _check(0 <= config.label_smoothing < 1, "label_smoothing", f"must be in [0, 1), got {config.label_smoothing}")
  _check(
    isinstance(config.randaugment_layers, int) and config.randaugment_layers >= 0,
    "randaugment_layers",
    f"must be an integer >= 0 (0 = off; big_vision's ViT recipe: 2), got {config.randaugment_layers!r}",
  )
  _check(
    0 <= config.randaugment_magnitude <= 30,
    "randaugment_magnitude",
    f"must be in [0, 30] (10 levels = the published operation ranges), got {config.randaugment_magnitude}",
  )
  _check(
    config.mixup >= 0,
    "mixup",
    f"must be >= 0 (0 = off; > 0 the Dirichlet concentration of the mixing ratio, big_vision 0.2), got {config.mixup}",
  )
  _check(
    isinstance(config.grad_accum_steps, int) and config.grad_accum_steps >= 1,
    "grad_accum_steps",
    f"must be an integer >= 1 (1 = off), got {config.grad_accum_steps!r}",
  )
  _check(config.base_lr > 0, "base_lr", f"must be > 0, got {config.base_lr}")
  _check(config.reference_batch_size >= 1, "reference_batch_size", f"must be >= 1, got {config.reference_batch_size}")
  _check(config.warmup_steps >= 0, "warmup_steps", f"must be >= 0, got {config.warmup_steps}")
  _check(0 <= config.momentum < 1, "momentum", f"must be in [0, 1), got {config.momentum}")
  _validate_optimizer(config)
  _validate_vit(config)
  _check(config.weight_decay >= 0, "weight_decay", f"must be >= 0, got {config.weight_decay}")
  scale = config.loss_scale_init
  _check(
    scale >= 1 and math.log2(scale).is_integer(),
    "loss_scale_init",
    f"must be a power of 2 >= 1 (e.g. 65536.0), got {scale}",
  )
  interval = config.loss_scale_growth_interval
  _check(
    isinstance(interval, int) and interval >= 1,
    "loss_scale_growth_interval",
    f"must be an integer >= 1 (e.g. 2000), got {interval!r}",
  )
  _check(config.grad_clip_norm >= 0, "grad_clip_norm", f"must be >= 0 (0 = off), got {config.grad_clip_norm}")


def _validate_vit(config: ml_collections.ConfigDict) -> None:
  """The ViT fields (they apply to ``vit_*`` models; the others ignore them)."""
  _check_choice(config, "vit_pool", ("tok", "gap"))
  _check_choice(config, "vit_posemb", ("learn", "sincos2d"))
  _check(
    isinstance(config.vit_patch_size, int) and config.vit_patch_size >= 0,
    "vit_patch_size",
    f"must be an integer >= 0 (0 = the model name's), got {config.vit_patch_size!r}",
  )
  for field in ("dropout", "stochastic_depth"):
    _check(0 <= config[field] < 1, field, f"must be in [0, 1), got {config[field]}")


def _validate_optimizer(config: ml_collections.ConfigDict) -> None:
  """``optimizer`` and the fields of the Adam family."""
  _check_choice(config, "optimizer", OPTIMIZERS)
  for field in ("b1", "b2"):
    _check(0 <= config[field] < 1, field, f"must be in [0, 1), got {config[field]}")
  _check(config.eps > 0, "eps", f"must be > 0, got {config.eps}")
  _check_choice(config, "mu_dtype", ("", "bfloat16", "float32"))
  _check(
    not config.mu_dtype or config.optimizer in ("adamw", "lion"),
    "mu_dtype",
    f"applies to optimizer='adamw' or 'lion' (their first moment), not {config.optimizer!r}; set it to ''",
  )


def _validate_run(config: ml_collections.ConfigDict) -> None:
  """How long the run trains, how often it logs, evaluates and saves; the data's fields."""
  _check(config.num_train_steps >= 1, "num_train_steps", f"must be >= 1, got {config.num_train_steps}")
  _check(config.log_every_steps >= 1, "log_every_steps", f"must be >= 1, got {config.log_every_steps}")
  _check(
    config.checkpoint_every_steps >= -1,
    "checkpoint_every_steps",
    f"must be >= 0 (0 = only at the end) or -1 (never), got {config.checkpoint_every_steps}",
  )
  _check(
    config.checkpoint_every_minutes >= 0,
    "checkpoint_every_minutes",
    f"must be >= 0 (0 = off), got {config.checkpoint_every_minutes}",
  )
  _check(
    config.time_limit_minutes >= 0,
    "time_limit_minutes",
    f"must be >= 0 (0 = no limit), got {config.time_limit_minutes}",
  )
  _check(config.keep_checkpoints >= 1, "keep_checkpoints", f"must be >= 1, got {config.keep_checkpoints}")
  _check(config.eval_every_steps >= 0, "eval_every_steps", f"must be >= 0, got {config.eval_every_steps}")
  _check(config.global_batch_size >= 1, "global_batch_size", f"must be >= 1, got {config.global_batch_size}")
  _check(config.num_epochs >= 0, "num_epochs", f"must be >= 0 (0 = use num_train_steps), got {config.num_epochs}")
  _check(config.warmup_epochs >= 0, "warmup_epochs", f"must be >= 0, got {config.warmup_epochs}")
  _check(0 < config.train_fraction <= 1, "train_fraction", f"must be in (0, 1], got {config.train_fraction}")
  _check(0 <= config.label_noise < 1, "label_noise", f"must be in [0, 1), got {config.label_noise}")
  if config.dataset != "digits":
    _check(
      config.train_fraction == 1 and config.label_noise == 0,
      "train_fraction",
      "train_fraction and label_noise apply to the embedded digits dataset only; leave them at 1.0 and 0.0",
    )
  _check(config.image_size >= 8, "image_size", f"must be >= 8, got {config.image_size}")
  _check(config.shuffle_buffer >= 1, "shuffle_buffer", f"must be >= 1, got {config.shuffle_buffer}")
  _check(
    0 <= config.calibration_fraction < 0.5,
    "calibration_fraction",
    f"must be in [0, 0.5) (a fraction of the train split), got {config.calibration_fraction}",
  )
  _check(
    isinstance(config.shift_examples, int) and config.shift_examples >= 0,
    "shift_examples",
    f"{config.shift_examples!r} must be a whole number >= 0 (0 = the whole test set)",
  )
  _check(
    config.eval_batch_size > 0,
    "eval_batch_size",
    f"{config.eval_batch_size} must be positive (it is rounded up to a multiple of the device count)",
  )


def _validate_mesh(config: ml_collections.ConfigDict, available_devices: int) -> tuple[int, int]:
  """The devices, the mesh ``(Dp, Dd)`` and the batch: what divides what."""
  p = config.num_particles
  _check(config.num_devices >= 0, "num_devices", f"must be >= 0 (0 = all), got {config.num_devices}")
  _check(
    config.particle_axis_size >= 0,
    "particle_axis_size",
    f"must be >= 0 (0 = gcd(num_particles, devices)), got {config.particle_axis_size}",
  )
  _check(config.num_cpu_devices >= 0, "num_cpu_devices", f"must be >= 0 (0 = leave), got {config.num_cpu_devices}")
  n = config.num_devices or available_devices
  _check(
    n <= available_devices,
    "num_devices",
    f"asks for {config.num_devices} devices but {available_devices} exist; "
    f"use num_devices=0 (all) or a value <= {available_devices}",
  )
  dp = config.particle_axis_size
  if dp:
    _check(
      n % dp == 0,
      "particle_axis_size",
      f"{dp} does not divide the {n} devices; use a divisor of {n} such as {math.gcd(p, n)}, "
      f"or 0 for gcd(num_particles, devices)",
    )
    _check(
      p % dp == 0,
      "num_particles",
      f"{p} particles cannot be split over particle_axis_size={dp}; use a multiple of {dp} "
      f"(e.g. {dp * max(1, p // dp)}), set particle_axis_size to a divisor of {p}, or 0 to choose "
      f"gcd({p}, devices) (e.g. {math.gcd(p, n)} on these {n} devices)",
    )
  dp, dd = mesh_lib.mesh_shape(p, n, dp)
  _check(
    config.resample_exchange != "ragged" or dp == 1 or jax.default_backend() != "cpu",
    "resample_exchange",
    "ragged needs a GPU or TPU (XLA:CPU does not implement ragged-all-to-all); use rounds or auto on the CPU",
  )
  _validate_batch(config, available_devices, dd)
  return dp, dd


def _validate_batch(config: ml_collections.ConfigDict, available_devices: int, dd: int) -> None:
  """The global batch over ``P x Dd`` shards, each shard's part over the micro-batches and the common examples."""
  p = config.num_particles
  g = config.global_batch_size
  axis = config.particle_axis_size
  fits = [
    d
    for d in range(1, available_devices + 1)
    if (not axis or d % axis == 0) and g % (p * mesh_lib.mesh_shape(p, d, axis)[1]) == 0
  ]
  _check(
    g % (p * dd) == 0,
    "global_batch_size",
    f"{g} is not divisible by num_particles x data devices = {p} x {dd} = {p * dd}; "
    f"use a multiple of {p * dd} such as {max(1, g // (p * dd)) * p * dd}"
    + (f", or run on num_devices in {fits}" if fits else ""),
  )
  k = config.grad_accum_steps
  shard = g // (p * dd)
  _check(
    shard % k == 0,
    "grad_accum_steps",
    f"{k} micro-batches do not divide the {shard} examples of a particle's part of a data shard "
    f"(global_batch_size / (num_particles x data devices) = {g} / ({p} x {dd})); use a divisor of {shard} "
    f"such as {max(d for d in range(1, k + 1) if shard % d == 0)}, or a global_batch_size that is a multiple "
    f"of {p * dd * k}",
  )
  if config.weigh_on == "common" and config.mode == "ipf":
    _check(
      config.common_examples <= shard,
      "common_examples",
      f"{config.common_examples} is more than the {shard} examples of a particle's part of a data shard "
      f"(global_batch_size / (num_particles x data devices)); use at most {shard}",
    )


def validate_data(config: ml_collections.ConfigDict, train_size: Optional[int], available_devices: int) -> None:
  """Checks that one global batch fits in the training set the config selects."""
  g = config.global_batch_size
  if train_size is None or train_size >= g:
    return
  dp, dd = mesh_lib.mesh_shape(config.num_particles, config.num_devices or available_devices, config.particle_axis_size)
  unit = config.num_particles * dd
  fit = f"at most {train_size}" + (
    f" (a multiple of {unit}, e.g. {train_size // unit * unit})" if train_size >= unit else ""
  )
  if config.dataset == "digits" and config.train_fraction < 1:
    raise ConfigError(
      "train_fraction",
      f"{config.train_fraction} keeps {train_size} training example"
      f"{'s' if train_size != 1 else ''}, fewer than one global batch (global_batch_size={g}); "
      f"raise train_fraction, or lower global_batch_size "
      f"to {fit}",
    )
  raise ConfigError(
    "global_batch_size", f"{g} is larger than the {config.dataset} training set ({train_size} examples); use {fit}"
  )

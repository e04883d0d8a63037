"""The outer loop's config (DESIGN.md §3b): ``config.sync`` and its fields, checked and resolved into the step's
``OuterSpec`` (``None``: the per-step filter)."""

from __future__ import annotations

import functools
import json
from typing import Optional

import ml_collections

from ipf_jax.config import defaults
from ipf_jax.errors import ConfigError
from ipf_jax.population.outer import SYNCS
from ipf_jax.spmd.spec import OuterSpec

SYNC_CHOICES = ("auto", "step") + SYNCS
SYNC_OPT_STATES = ("keep", "reset", "average")
# What only the per-step filter does, and why the outer loop refuses it: sync="auto" keeps the per-step filter for
# a run that asks for one of these, or that changes one of PER_STEP_SETTINGS from its default (the outer loop
# reads none of them: its syncs weigh every particle on the same examples at sync_temperature, and average
# rather than correct).
PER_STEP_ONLY = {
  "elastic_pull": "the outer loop pulls at syncs by sync_pull",
  "resample_every": "the outer loop resamples at syncs, on low ESS",
  "shared_params": "shared parameters take the particles' consensus gradient every step",
  "fsdp": "the anchor is kept whole, not as shards",
  "compress_correction": "the outer loop averages parameters, not gradients",
}
PER_STEP_SETTINGS = ("correction", "temperature", "weigh_on")


@functools.cache
def _per_step_defaults() -> dict:
  """``PER_STEP_SETTINGS``' default values (the schema's), read once."""
  config = defaults.get_config()
  return {f: config[f] for f in PER_STEP_SETTINGS}


def resolve(config, sync: Optional[str] = None) -> str:
  """``config.sync`` (or ``sync`` in its place) with ``"auto"`` resolved (``config``: a ``ConfigDict`` or a saved
  config's dict): the outer loop with QSR's syncs for a population in ipf mode (measured ahead of the per-step
  filter at every batch, BENCHMARKS.md), the per-step filter (``"step"``) for one model, an ensemble, or a run
  that asks for what only it does (``PER_STEP_ONLY``, float16's one loss scale, a ``PER_STEP_SETTINGS`` field
  changed from its default)."""
  sync = sync or config.get("sync", "step")
  if sync != "auto":
    return sync
  particles = config.get("num_particles", 1)
  population = config.get("mode") == "ipf" and isinstance(particles, int) and particles > 1
  per_step = (
    any(config.get(f) for f in PER_STEP_ONLY)
    or config.get("dtype") == "float16"
    or any(config.get(f, d) != d for f, d in _per_step_defaults().items())
  )
  return "qsr" if population and not per_step else "step"


def recorded(config: ml_collections.ConfigDict) -> dict:
  """The config as a run records it (``config.json``, a checkpoint's meta, the trackers): JSON values, with
  ``sync`` the program ``"auto"`` chose, so the record says what ran whatever a later version's ``auto`` picks."""
  d = json.loads(config.to_json())
  d["sync"] = resolve(config)
  return d


def outer_spec(config: ml_collections.ConfigDict) -> Optional[OuterSpec]:
  """The outer loop's settings when ``config.sync`` asks for it (a population in ipf mode, or one DDP replica
  with an outer optimizer: Lookahead), else None."""
  sync = resolve(config)
  if sync == "step" or config.mode == "ensemble" or config.num_particles == 1 and config.mode == "ipf":
    return None
  return OuterSpec(**{f: config[f] for f in OuterSpec.__dataclass_fields__ if f != "sync"}, sync=sync)


def _check(cond: bool, field: str, message: str) -> None:
  if not cond:
    raise ConfigError(field, message)


def validate_sync(config: ml_collections.ConfigDict) -> None:
  """``sync`` and its fields; the outer loop in ipf mode with several particles, without what needs a
  collective over the particles every step (shared parameters, float16's one loss scale, the compressed
  correction) or shards of particles (fsdp)."""
  _check(config.sync in SYNC_CHOICES, "sync", f"must be one of {SYNC_CHOICES}, got {config.sync!r}")
  _check(
    config.sync_opt_state in SYNC_OPT_STATES,
    "sync_opt_state",
    f"must be one of {SYNC_OPT_STATES}, got {config.sync_opt_state!r}",
  )
  every = config.sync_every
  _check(isinstance(every, int) and every >= 1, "sync_every", f"must be an integer >= 1, got {every!r}")
  _check(config.sync_qsr_alpha > 0, "sync_qsr_alpha", f"must be > 0, got {config.sync_qsr_alpha}")
  _check(
    0 <= config.sync_swap_fraction <= 1,
    "sync_swap_fraction",
    f"must be in [0, 1], got {config.sync_swap_fraction}",
  )
  _check(0 <= config.sync_pull <= 1, "sync_pull", f"must be in [0, 1] (1: local SGD), got {config.sync_pull}")
  _check(
    config.sync_temperature >= 0,
    "sync_temperature",
    f"must be >= 0 (0: the uniform mean), got {config.sync_temperature}",
  )
  examples = config.sync_examples
  _check(isinstance(examples, int) and examples >= 1, "sync_examples", f"must be an integer >= 1, got {examples!r}")
  _check(config.outer_lr > 0, "outer_lr", f"must be > 0 (1 with outer_momentum=0: the mean), got {config.outer_lr}")
  _check(0 <= config.outer_momentum < 1, "outer_momentum", f"must be in [0, 1), got {config.outer_momentum}")
  sync = resolve(config)
  if sync == "step":
    return
  _check(
    config.mode == "ipf" and config.num_particles > 1 or config.mode == "ddp" and sync != "swap",
    "sync",
    f"={sync!r} is the outer loop of a population in mode='ipf' (or, every/qsr, of one DDP model with "
    f"an outer optimizer); this run has mode={config.mode!r} with num_particles={config.num_particles}. Set "
    "mode='ipf' and num_particles > 1, mode='ddp' for one model with an outer optimizer, or sync='step'",
  )
  _check(
    config.mode != "ddp" or config.outer_lr != 1.0 or config.outer_momentum > 0 or config.sync_pull < 1,
    "outer_lr",
    f"mode='ddp' with sync={sync!r}, outer_lr=1, outer_momentum=0 and sync_pull=1 is plain DDP (the anchor "
    "is the model): set outer_lr < 1 (Lookahead: 0.5) or outer_momentum > 0, or sync='step'",
  )
  for field, why in PER_STEP_ONLY.items():
    value = config[field]
    _check(not value, field, f"={value!r} does not work with sync={sync!r}: {why}; leave it off or sync='step'")
  _check(
    config.dtype != "float16",
    "dtype",
    f"='float16' keeps one loss scale for all particles, agreed every step; sync={sync!r} has no collective "
    "between syncs. Use bfloat16 or float32, or sync='step'",
  )

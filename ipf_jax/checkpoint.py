"""Orbax checkpoints of the whole particle state: save, resume, resharded restore.

Layout: ``WORKDIR/checkpoints/<step>/{state,meta}``. Orbax writes each save in a
temporary directory and renames it when complete, so a save cut off by a crash
never replaces the last complete checkpoint. A checkpoint that cannot be read
is moved aside to ``<step>.unreadable`` (kept, never deleted) and the previous
one is used.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Optional

import jax
import ml_collections
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

log = logging.getLogger("ipf_jax")

# Fields that fix the shapes or meaning of the saved state: a checkpoint only
# restores into a run that agrees on them. Device counts and mesh shape may
# differ (the particle axis is resharded on restore).
STRUCTURAL_FIELDS = ("dataset", "model", "cnn_features", "num_particles", "grad_accum_steps",
                     "shared_params")
# Fields where one side of a switch changes the saved state's structure: the optimizer state
# (zero vs non-zero), the compression residuals, float16's loss scale. Both runs must be on the same side.
STATE_SWITCHES = {"momentum": bool, "weight_decay": bool, "grad_clip_norm": bool, "compress_correction": bool,
                  "dtype": lambda dtype: dtype == "float16"}


class CheckpointError(RuntimeError):
  """A checkpoint that cannot be used by this run; the message says why and what to do."""


def _config_value(config: dict, field: str) -> Any:
  v = config.get(field)
  return list(v) if isinstance(v, (tuple, list)) else v


def check_compatible(saved: dict, config: ml_collections.ConfigDict, where: str) -> None:
  """Raises ``CheckpointError`` naming the first field that differs in a way the state cannot follow."""
  current = json.loads(config.to_json())
  for field in STRUCTURAL_FIELDS:
    if _config_value(saved, field) != _config_value(current, field):
      raise CheckpointError(
          f"the checkpoint in {where} was written with config.{field}={saved.get(field)!r}, this run has "
          f"config.{field}={current.get(field)!r}. Resume with --config.{field}={saved.get(field)!r}, or use a new "
          "--workdir to start a fresh run.")
  for field, switch in STATE_SWITCHES.items():
    if switch(saved.get(field)) != switch(current.get(field)):
      raise CheckpointError(
          f"the checkpoint in {where} was written with config.{field}={saved.get(field)!r}, this run has "
          f"config.{field}={current.get(field)!r}: that changes what the saved state holds (optimizer state, "
          f"compression residuals or float16's loss scale). Resume with --config.{field}={saved.get(field)!r}, "
          "or use a new --workdir.")


class Checkpointer:
  """Saves every ``every_steps`` steps (and when asked), keeps the last ``keep``."""

  def __init__(self, workdir: str, keep: int = 3, async_save: bool = True):
    self.directory = epath.Path(workdir) / "checkpoints"
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
    self.manager = ocp.CheckpointManager(self.directory.absolute(), options=options, item_names=("state", "meta"))

  def latest_step(self) -> Optional[int]:
    return self.manager.latest_step()

  def save(self, step: int, state, config: ml_collections.ConfigDict) -> None:
    meta = {"step": int(step), "config": json.loads(config.to_json()), "num_devices": jax.device_count(),
            "num_processes": jax.process_count()}
    self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    meta=ocp.args.JsonSave(meta)), force=True)

  def _set_aside(self, step: int, error: Exception) -> None:
    path = self.directory / str(step)
    aside = self.directory / f"{step}.unreadable"
    log.error("checkpoint %s cannot be read (%s: %s); moved to %s, falling back to the previous one",
              path, type(error).__name__, str(error).splitlines()[0][:300], aside)
    if jax.process_index() == 0:
      os.rename(path, aside)
    multihost_utils.sync_global_devices(f"ipf_jax_set_aside_{step}")
    self.manager.reload()

  def restore_latest(self, abstract_state, config: ml_collections.ConfigDict):
    """The newest readable checkpoint as ``(state, meta)``, resharded onto
    ``abstract_state``'s shardings, or ``None`` if there is none."""
    for step in sorted(self.manager.all_steps(), reverse=True):
      where = str(self.directory / str(step))
      try:
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
      except Exception as e:  # noqa: BLE001 - any unreadable file means: use the previous checkpoint
        self._set_aside(step, e)
        continue
      check_compatible(meta["config"], config, where)
      try:
        state = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state)))["state"]
      except Exception as e:  # noqa: BLE001
        self._set_aside(step, e)
        continue
      return state, meta
    return None

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()

"""Orbax checkpoints of the whole particle state: save, resume, resharded restore (DESIGN.md "Durability").

Layout: ``WORKDIR/checkpoints/<step>/{state,meta}``. Orbax writes each save in
a temporary directory and renames it when complete, so a save cut off by a
crash never replaces a complete checkpoint; old checkpoints are deleted only
after a newer one is committed.

Restoring tells three cases apart and never guesses:

- **incompatible** (``compatibility``): the saved state's tree, shapes or dtypes differ from what
  this run's config builds. The run stops with one error naming the first
  differing path and the config field(s) that decide it (found by rebuilding
  the state's shapes with each differing field set back to its saved value,
  so a new field cannot be forgotten). Nothing is touched.
- **unreadable**: the checkpoint's own files are not what was written. Decided by looking at them,
  never from an error's text: each committed save lists its files and their sizes in
  ``<step>/files.json`` (``FILE_LIST``), and a listed file that is missing or of another size is
  damage; a checkpoint without the list (one cut off right after its commit) needs its two
  metadata files to parse, and a restore that fails on a missing file or undecodable JSON
  (``FileNotFoundError``, ``json.JSONDecodeError``, by class) is damage too. It is skipped; once an
  older one restores, the unreadable newer ones are moved aside to ``<step>.unreadable`` (kept) so
  that training can write those steps again. If none can be read, the run stops with an error
  listing them and touches nothing.
- anything else (out of memory, a lost peer, a file of the right size whose bytes changed): an error
  naming the checkpoint; nothing is moved.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from typing import Callable, Optional

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from ipf_jax import files
from ipf_jax.config import sync as sync_lib
from ipf_jax.runtime import quiet
from ipf_jax.runtime import workdir as workdir_lib
from ipf_jax.runtime.compatibility import CheckpointError, Signature, check_compatible, signature
from ipf_jax.spmd import mesh as mesh_lib

log = logging.getLogger("ipf_jax")

ASIDE_SUFFIX = ".unreadable"
FILE_LIST, list_files, damage = files.FILE_LIST, files.list_files, files.damage  # one reader, init_from's too


class SaveError(CheckpointError):
  """Writing a checkpoint failed (full disk, lost permissions, ...); the older checkpoints are kept."""


# What a failed write says, in the words of the operating system (TensorStore wraps them in long messages).
_OS_ERRORS = (
  "File too large",
  "Disk quota exceeded",
  "Read-only file system",
  "Permission denied",
  "Input/output error",
)


def _save_cause(error: BaseException) -> str:
  """One short cause of a failed save: "no space left on the device", "File too large", ..."""
  e, texts = error, []
  while e is not None:
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
      return "no space left on the device" + (f" ({e.strerror})" if e.strerror != "No space left on device" else "")
    texts.append(str(e))
    e = e.__cause__ or e.__context__
  text = " ".join(texts)
  if "RESOURCE_EXHAUSTED" in text or "No space left" in text:
    return "no space left on the device"
  for known in _OS_ERRORS:
    if known in text:
      return known
  e = error
  while e is not None:
    if isinstance(e, OSError) and e.strerror:
      return f"{e.strerror} ({e.filename})" if e.filename else e.strerror
    e = e.__cause__ or e.__context__
  return str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__


def _unreadable(error: BaseException) -> Optional[str]:
  """The reason, if ``error`` (or its cause) is a file of the checkpoint missing or undecodable, by class."""
  e = error
  while e is not None:
    if isinstance(e, (FileNotFoundError, IsADirectoryError, NotADirectoryError, json.JSONDecodeError)):
      return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    e = e.__cause__ or e.__context__
  return None


def _particle_devices(state) -> int:
  """``Dp``, the devices of the particle axis the state lives on (1 off a mesh): ``meta["particle_devices"]``."""
  sharding = getattr(state.log_weights, "sharding", None)
  return int(dict(getattr(getattr(sharding, "mesh", None), "shape", {})).get(mesh_lib.PARTICLE, 1))


class Checkpointer:
  """Saves every time it is asked, keeps the newest ``keep``; restores the newest one that can be used.

  ``read_only`` (``--eval_only``): creates nothing, moves nothing, skips what it cannot read.
  """

  def __init__(
    self,
    workdir: str,
    keep: int = 3,
    async_save: bool = True,
    read_only: bool = False,
    data_name: Optional[str] = None,
    optimizer: Optional[dict] = None,
  ):
    self.directory = epath.Path(workdir).absolute() / "checkpoints"
    self.keep, self.async_save, self.read_only, self.data_name = keep, async_save, read_only, data_name
    self.optimizer = optimizer  # optim.optimizer_record of this run: saved, and compared on restore
    self._manager = None  # created at the first save: a run that is refused creates nothing
    self._pending: Optional[int] = None  # step of the save in flight

  # ---- listing -------------------------------------------------------------------------------
  def steps(self) -> list[int]:
    """Complete checkpoints (orbax renames a save to its step number when it is complete), ascending."""
    return files.checkpoint_steps(str(self.directory))

  def set_aside(self) -> list[str]:
    if not self.directory.is_dir():
      return []
    return sorted(p.name for p in self.directory.iterdir() if ASIDE_SUFFIX in p.name)

  def latest_step(self) -> Optional[int]:
    steps = self.steps()
    return steps[-1] if steps else None

  # ---- saving --------------------------------------------------------------------------------
  def _ensure_manager(self) -> ocp.CheckpointManager:
    if self._manager is None:
      # max_to_keep is ours (_collect): orbax's garbage collection deletes old steps even when the new save failed.
      options = ocp.CheckpointManagerOptions(max_to_keep=None, enable_async_checkpointing=self.async_save, create=True)
      self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))
    return self._manager

  def save(self, step: int, state, config: ml_collections.ConfigDict, rewind: Optional[dict] = None) -> None:
    """Starts saving ``state`` as ``step`` (in the background with ``async_save``); raises ``SaveError`` if
    this or the previous save failed, or if the disk cannot hold it (checked before writing anything).
    ``rewind``: the rewind watch's record (``config.rewind``: its count and data offset), kept in the meta."""
    assert not self.read_only
    manager = self._ensure_manager()
    self.wait()  # the previous save is committed (or its failure raised) before anything is deleted
    if step in self.steps():
      return  # already saved (e.g. a stop right after a periodic save)
    self._check_space(step, state)
    meta = {
      "step": int(step),
      "config": sync_lib.recorded(config),
      "num_devices": jax.device_count(),
      "particle_devices": _particle_devices(state),
      "num_processes": jax.process_count(),
      "data": self.data_name,
      "optimizer": self.optimizer,
      **({"rewind": rewind} if rewind is not None else {}),
    }
    self._pending = step
    quiet.arm()  # until it is committed (wait)
    try:
      manager.save(
        step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True
      )
    except Exception as e:  # noqa: BLE001
      raise self._save_error(step, e) from None
    if not self.async_save:
      self.wait()

  def poll(self) -> None:
    """Finishes a background save that has ended: raises ``SaveError`` at once if it failed."""
    if self._manager is None or self._pending is None:
      return
    if not self._manager.is_saving_in_progress():
      self.wait()

  def _check_space(self, step: int, state) -> None:
    """A save needs about as much space as the newest checkpoint (or the state's bytes for the first one)."""
    steps = self.steps()
    if steps:
      needed = sum(list_files(str(self.directory / str(steps[-1]))).values())
    else:
      needed = sum(x.nbytes for x in jax.tree.leaves(state))
    needed = int(needed * 1.05) + (1 << 20)
    free = shutil.disk_usage(self.directory).free
    if free < needed:
      raise self._save_error(step, OSError(errno.ENOSPC, f"about {workdir_lib.size_text(needed)} needed"))

  def wait(self) -> None:
    """Waits for the save in flight; raises ``SaveError`` if it failed; then drops checkpoints beyond ``keep``."""
    if self._manager is None:
      return
    try:
      self._manager.wait_until_finished()
      self._manager.check_for_errors()
    except Exception as e:  # noqa: BLE001
      raise self._save_error(self._pending, e) from None
    if self._pending is not None and self._pending not in self.steps():
      raise self._save_error(self._pending, RuntimeError("the save did not produce a complete checkpoint"))
    if self._pending is not None:
      self._write_file_list(self._pending)
      quiet.disarm()
    self._pending = None
    self._collect()

  def _write_file_list(self, step: int) -> None:
    """``FILE_LIST`` of a committed checkpoint, by process 0 alone (no barrier: ``poll`` may finish a save on
    one process before another). Written outside the step's folder, then renamed into it, so that nothing in
    the folder disappears while another process measures it (``_check_space``). The list is optional: if it
    cannot be written (a full disk), the checkpoint stays complete without it."""
    if jax.process_index() != 0:
      return
    path = str(self.directory / str(step))
    tmp = str(self.directory / f".{step}.{FILE_LIST}.tmp")
    try:
      files = list_files(path)
      with open(tmp, "w") as f:
        json.dump(files, f)
      os.replace(tmp, os.path.join(path, FILE_LIST))
    except OSError as e:
      log.warning(
        "checkpoint %s is complete, but its file list could not be written (%s): a damaged file in it "
        "would stop a resume instead of being set aside",
        path,
        e.strerror or e,
      )
      try:
        os.remove(tmp)
      except OSError:
        pass

  def _collect(self) -> None:
    """Deletes the oldest complete checkpoints beyond ``keep`` (only after the newest is committed)."""
    self._manager.reload()
    for step in self.steps()[: -self.keep]:
      self._manager.delete(step)

  def _save_error(self, step: Optional[int], error: BaseException) -> SaveError:
    quiet.after_orbax_failure()  # its writers' leftover tracebacks (quiet.py)
    cause = _save_cause(error)
    kept = [s for s in self.steps() if s != step]
    newest = f"the newest complete checkpoint is step {kept[-1]} (kept)" if kept else "no complete checkpoint exists"
    return SaveError(
      f"saving checkpoint {step} to {self.directory} failed: {cause}; "
      f"{workdir_lib.free_space(str(self.directory))} there. {newest[0].upper() + newest[1:]}. "
      "Free some space (or fix the directory), then rerun the same command to resume."
    )

  def close(self) -> None:
    """Waits for the save in flight (raising ``SaveError`` if it failed) and releases orbax's threads."""
    if self._manager is None:
      return
    try:
      self.wait()
    finally:
      self._manager.close()
      self._manager = None

  def abandon(self) -> None:
    """Releases orbax's threads after a failure, without raising."""
    if self._manager is not None:
      try:
        self._manager.close()
      except Exception:  # noqa: BLE001
        pass
      self._manager = None

  # ---- restoring -----------------------------------------------------------------------------
  def _read(self, step: int):
    """``(meta, saved signature)`` of one checkpoint, or ``(None, reason)`` if its files cannot be read."""
    path = self.directory / str(step)
    why = damage(str(path))
    if why is not None:
      return None, why
    quiet.arm()
    try:
      with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as ckptr:
        meta = ckptr.restore(path / "meta")
      with ocp.StandardCheckpointer() as ckptr:
        metadata = ckptr.metadata(path / "state")
      why = text = None
      quiet.disarm()
    except Exception as e:  # noqa: BLE001
      quiet.after_orbax_failure()
      why, text = _unreadable(e), f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
      if why is not None:
        return None, why
    if text is not None:
      raise CheckpointError(f"cannot read {path}: {text}. The checkpoint was left as it is.")
    tree = getattr(getattr(metadata, "item_metadata", None), "tree", None)
    if tree is None or not isinstance(meta, dict) or "config" not in meta:
      return None, "its metadata (state/_METADATA or meta/metadata) is missing or unreadable"
    return meta, signature(tree)

  def restore_latest(
    self,
    abstract_state,
    config: ml_collections.ConfigDict,
    shapes_for: Optional[Callable[[ml_collections.ConfigDict], Signature]] = None,
    wanted: Optional[Callable[[dict], bool]] = None,
  ):
    """The newest usable checkpoint as ``(state, meta)``, resharded onto ``abstract_state``'s shardings;
    ``None`` when the workdir has no checkpoint at all. ``wanted(meta)`` False passes over a readable checkpoint
    (a rewind's: one saved inside a spike), leaving it as it is.

    Raises:
      CheckpointError: an incompatible checkpoint (nothing touched), every checkpoint unreadable
        (nothing touched), or a restore that failed for another reason.
    """
    steps = self.steps()
    if not steps:
      aside = self.set_aside()
      if aside:
        raise CheckpointError(
          f"{self.directory} holds no checkpoint that can be used, only ones set aside earlier as unreadable "
          f"({', '.join(aside)}). Nothing was changed. To start a new run, use a new --workdir (or move "
          f"{self.directory} away)."
        )
      return None
    current = signature(abstract_state)
    damaged = []
    for step in reversed(steps):
      where = str(self.directory / str(step))
      state, (meta, saved_or_why) = None, self._read(step)
      if meta is not None and wanted is not None and not wanted(meta):
        continue
      why = None if meta is not None else saved_or_why
      if why is None:
        self._check(meta, saved_or_why, current, config, where, shapes_for)
        state, why = self._restore(step, abstract_state)
      if not _everywhere(why is None):
        damaged.append((step, why or "another process could not read its part of it"))
        log.error("checkpoint %s cannot be read (%s)", where, damaged[-1][1])
        continue
      for bad, _ in damaged:
        self._move_aside(bad)
      if not self.read_only and not os.path.isfile(os.path.join(where, FILE_LIST)):
        self._write_file_list(step)  # a checkpoint cut off before its list (or an older version's) gets one
      return state, meta
    if not damaged:
      return None  # every checkpoint readable and passed over (``wanted``)
    listing = "; ".join(f"{step}: {why}" for step, why in damaged)
    raise CheckpointError(
      f"no checkpoint in {self.directory} can be read ({listing}). Nothing was changed and training did not start "
      "over. If the files can be recovered, restore them and run again; to start a new run instead, use a new "
      f"--workdir (or move {self.directory} away)."
    )

  def check_latest(
    self,
    abstract_state,
    config: ml_collections.ConfigDict,
    shapes_for: Optional[Callable[[ml_collections.ConfigDict], Signature]] = None,
  ) -> Optional[tuple[int, dict]]:
    """``--dry_run``: the step ``restore_latest`` would resume from and its saved config, after the same
    compatibility check, from the checkpoints' metadata only (nothing restored, moved or written);
    ``None``: no checkpoint."""
    current = signature(abstract_state)
    for step in reversed(self.steps()):
      meta, saved_or_why = self._read(step)
      if meta is not None:
        self._check(meta, saved_or_why, current, config, str(self.directory / str(step)), shapes_for)
        return step, meta["config"]
    if self.steps() or self.set_aside():
      raise CheckpointError(
        f"no checkpoint in {self.directory} can be read: a run would stop here. Nothing was changed."
      )
    return None

  def _check(self, meta: dict, saved: Signature, current: Signature, config, where: str, shapes_for) -> None:
    """``check_compatible`` of one checkpoint's meta and signature against this run."""
    check_compatible(
      saved,
      meta["config"],
      current,
      config,
      where,
      shapes_for,
      meta.get("data"),
      self.data_name,
      meta.get("optimizer"),
      self.optimizer,
    )

  def _restore(self, step: int, abstract_state):
    """``(state, None)``, or ``(None, reason)`` when the checkpoint's files cannot be read."""
    where = self.directory / str(step)
    quiet.arm()
    try:
      with ocp.StandardCheckpointer() as ckptr:
        state = ckptr.restore(where / "state", abstract_state)
      quiet.disarm()
      return state, None
    except Exception as e:  # noqa: BLE001
      quiet.after_orbax_failure()
      why, text = _unreadable(e), f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    if why is None:
      raise CheckpointError(f"cannot restore {where}: {text}. The checkpoint was left as it is.")
    return None, why

  def _move_aside(self, step: int) -> None:
    path = self.directory / str(step)
    if self.read_only:
      log.error("skipping unreadable checkpoint %s (left in place: --eval_only moves nothing)", path)
      return
    aside = self.directory / f"{step}{ASIDE_SUFFIX}"
    n = 1
    while aside.exists():
      aside = self.directory / f"{step}{ASIDE_SUFFIX}.{n}"
      n += 1
    if jax.process_index() == 0:
      os.rename(path, aside)
    log.error(
      "moved the unreadable checkpoint %s to %s (kept, never deleted): training writes step %d again",
      path,
      aside.name,
      step,
    )
    _sync(f"ipf_jax_set_aside_{step}")


def _everywhere(ok: bool) -> bool:
  """``ok`` on every process (one process: ``ok``)."""
  if jax.process_count() == 1:
    return ok
  from jax.experimental import multihost_utils

  return bool(np.all(multihost_utils.process_allgather(np.array(ok))))


def _sync(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)

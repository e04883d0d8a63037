"""Does a checkpoint fit this run: the state's signature (tree, shapes, dtypes), the config fields that decide
it, the fields that changed since it was written (DESIGN.md "Durability"). Used by ``checkpoint`` before
anything is restored, and by ``trainer`` for its warnings and ``--dry_run`` plan."""

from __future__ import annotations

import json
from typing import Callable, Optional

import jax
import ml_collections
import numpy as np

from ipf_jax.config import defaults
from ipf_jax.config import sync as sync_lib

Signature = dict  # {"params/Conv_0/kernel": ((8, 3, 3, 1, 32), "float32"), ...}


class CheckpointError(RuntimeError):
  """A checkpoint that this run cannot use; the message says why and what to do."""


def _key_name(k) -> str:
  for attr in ("name", "key", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def signature(tree) -> Signature:
  """``{path: (shape, dtype)}`` of every array leaf of a state, an abstract state or orbax tree metadata."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {"/".join(_key_name(k) for k in path): (tuple(leaf.shape), str(np.dtype(leaf.dtype))) for path, leaf in flat}


def _describe(path: str, saved: Signature, current: Signature) -> str:
  def fmt(entry):
    return f"{entry[0]} {entry[1]}" if entry else "absent"

  return f"{path} is {fmt(saved.get(path))} there and {fmt(current.get(path))} here"


def _flat_config(config) -> dict:
  """The config's fields as JSON values, ``sync="auto"`` as what it resolves to (a run saved with ``"step"``
  resumes as ``"auto"`` where that gives ``"step"``; named as the program it is in every message)."""
  d = config if isinstance(config, dict) else json.loads(config.to_json())
  flat = {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in d.items()}
  if "sync" in flat:
    flat["sync"] = sync_lib.resolve(flat)
  return flat


# The fields' kinds on resume are the schema's (``config.defaults``): HOW changes silently, IDENTITY is refused.
HOW_FIELDS = defaults.HOW
MEANING_FIELDS = defaults.IDENTITY


# Config fields a dataset's name records (``ArrayDataset.holdout`` adds "(0.1 held out)"): when a checkpoint's
# data name differs from this run's, those that differ are named in the refusal.
DATA_FIELDS = ("dataset", "calibration_fraction")


def check_meaning(saved_config: dict, config: ml_collections.ConfigDict, where: str) -> None:
  """Raises ``CheckpointError`` naming each of ``MEANING_FIELDS`` whose value differs from the checkpoint's."""
  saved, current = _flat_config(saved_config), _flat_config(config)
  fields = [k for k in MEANING_FIELDS if k in saved and k in current]
  differing = _differences(saved, current, fields)
  if not differing:
    return
  was = ", ".join(f"config.{k}={a}" for k, a, _ in differing)
  now = ", ".join(f"config.{k}={b}" for k, _, b in differing)
  flags = " ".join(f"--config.{k}={_flag_value(saved[k])}" for k, _, _ in differing)
  raise CheckpointError(
    f"the run in {where} was trained with {was}; this run has {now}. Resuming it would continue that run, "
    "not train this one, so its results would not be this run's. Use a new --workdir for this run (without "
    "--workdir, train.py names one after the config, the mode and sync, so another mode or sync trains beside "
    f"it), or resume that run with {flags}. "
    "Nothing was changed."
  )


def _differences(saved: dict, current: dict, fields) -> list[tuple[str, str, str]]:
  """``(field, saved value, current value)`` (``repr``, or ``absent`` where a config lacks it) for each of
  ``fields`` whose values differ."""
  missing, shown = object(), lambda d, k: repr(d[k]) if k in d else "absent"
  return [(k, shown(saved, k), shown(current, k)) for k in fields if saved.get(k, missing) != current.get(k, missing)]


def changed_fields(saved_config: dict, config: ml_collections.ConfigDict) -> list[str]:
  """``"field: saved -> now"`` for every field outside ``HOW_FIELDS`` whose value differs from the saved
  config's (a field one of them lacks: ``absent``)."""
  saved, current = _flat_config(saved_config), _flat_config(config)
  return [
    f"{k}: {a} -> {b}" for k, a, b in _differences(saved, current, sorted((set(saved) | set(current)) - HOW_FIELDS))
  ]


def placement_note(config: ml_collections.ConfigDict, meta: dict, particle_devices: int) -> Optional[str]:
  """What a resume onto another particle mesh changes with ``resample_placement="local"`` (copies placed by
  ``Dp`` and ``L``: the run leaves the uninterrupted one at its next resampling), or ``None`` (the ascending
  placement, the same particle mesh, or a checkpoint that did not record it)."""
  saved = meta.get("particle_devices")
  if config.get("resample_placement") != "local" or saved in (None, particle_devices):
    return None
  return (
    f"resample_placement=local places the copies by the particle mesh: the checkpoint was written on {saved} "
    f"particle device(s), this run has {particle_devices}, so from its next resampling on it is not the run the "
    "checkpoint's mesh would have trained (each particle's expected number of copies is the same)"
  )


def decisive_fields(
  saved_config: dict, config: ml_collections.ConfigDict, shapes_for: Callable[[ml_collections.ConfigDict], Signature]
) -> list[str]:
  """Config fields whose saved value, put back alone into ``config``, changes the state's shapes."""
  saved, current = _flat_config(saved_config), _flat_config(config)
  saved.setdefault("sync", "step")  # a checkpoint from before the outer loop: the per-step filter's state
  base = shapes_for(config)
  fields = []
  for field in sorted(set(saved) & set(current)):
    if saved[field] == current[field]:
      continue
    try:
      trial = ml_collections.ConfigDict(config.to_dict())
      value = saved[field]
      trial[field] = tuple(value) if isinstance(value, list) else value
      if shapes_for(trial) != base:
        fields.append(field)
    except Exception:  # noqa: BLE001 - a value this code cannot build a state from says nothing
      continue
  return fields


def check_compatible(
  saved_sig: Signature,
  saved_config: dict,
  current_sig: Signature,
  config: ml_collections.ConfigDict,
  where: str,
  shapes_for: Optional[Callable[[ml_collections.ConfigDict], Signature]] = None,
  saved_data: Optional[str] = None,
  data: Optional[str] = None,
  saved_optimizer: Optional[dict] = None,
  optimizer: Optional[dict] = None,
) -> None:
  """Raises ``CheckpointError`` when the saved state cannot be restored into this run's state, or was
  trained on other data (``saved_data`` / ``data``: the datasets' names; shapes may agree).
  ``saved_optimizer`` / ``optimizer``: ``optim.optimizer_record`` of the checkpoint's and this run's
  optimizers (older checkpoints have none), named when only the optimizer state differs."""
  saved_flat, current_flat = _flat_config(saved_config), _flat_config(config)
  if saved_data and data and saved_data != data:
    fields = [
      f"config.{k} is {a} there and {b} here" for k, a, b in _differences(saved_flat, current_flat, DATA_FIELDS)
    ]
    raise CheckpointError(
      f"the checkpoint in {where} was trained on {saved_data!r}, this run reads {data!r} ("
      + ("; ".join(fields) if fields else "config.dataset, or the data you pass")
      + "). Run with the "
      "checkpoint's values (its config.json), or use a new --workdir to start a fresh run. Nothing was changed."
    )
  if saved_sig == current_sig:
    return check_meaning(saved_config, config, where)
  differing = sorted(
    (p for p in set(saved_sig) | set(current_sig) if saved_sig.get(p) != current_sig.get(p)),
    key=lambda p: (not p.startswith("params/"), p),
  )  # a parameter says it best
  what = _describe(differing[0], saved_sig, current_sig)
  if len(differing) > 1:
    what += f" ({len(differing) - 1} more difference{'s' if len(differing) > 2 else ''})"
  fields = decisive_fields(saved_config, config, shapes_for) if shapes_for else []
  optimizer_note = _optimizer_cause(
    saved_optimizer, optimizer, saved_flat, all(p.split("/")[0] in OPTIMIZER_LEAVES for p in differing)
  )
  if fields:
    was = ", ".join(f"config.{f}={saved_flat[f]!r}" for f in fields)
    now = ", ".join(f"config.{f}={current_flat[f]!r}" for f in fields)
    flags = " ".join(f"--config.{f}={_flag_value(saved_flat[f])}" for f in fields)
    also = f" {optimizer_note}" if optimizer_note else ""
    cause = f"It was written with {was}; this run has {now}.{also} Resume with {flags}, or"
  elif optimizer_note:
    cause = (
      f"{optimizer_note} Resume with the optimizer that wrote it (train_and_evaluate or "
      "evaluate_checkpoint(optimizer=...)), or"
    )
  else:
    cause = (
      "The config fields that shape the state agree, so it was probably written by another version of "
      "ipf_jax; resume with that version, or"
    )
  raise CheckpointError(
    f"the checkpoint in {where} does not fit this run's state: {what}. {cause} use a new "
    "--workdir to start a fresh run. Nothing was changed."
  )


OPTIMIZER_LEAVES = ("opt_state", "shared_opt_state")  # the state's fields that only the optimizer shapes


def _optimizer_words(record: dict) -> str:
  return f"{record.get('name', '?')} (state: {record.get('state', '?')})"


def _optimizer_cause(
  saved: Optional[dict], current: Optional[dict], saved_config: dict, only_optimizer: bool
) -> Optional[str]:
  """A sentence on the two optimizers when they explain the difference, else ``None``.

  ``saved`` is ``None`` for a checkpoint older than the record: the config's SGD wrote it (no other
  optimizer could be given then), which explains the difference only when this run's optimizer is another."""
  if not current or (not saved and (current.get("builtin") or not only_optimizer)):
    return None
  here = _optimizer_words(current)
  if not saved:
    return (
      f"Only the optimizer state differs: the checkpoint predates the record of its optimizer, so the "
      f"config's SGD (momentum {saved_config.get('momentum', '?')}) wrote it, and this run's optimizer is "
      f"{here}."
    )
  if saved == current:
    return (
      None
      if not only_optimizer
      else (
        f"Only the optimizer state differs, though both optimizers record as {here}: they are two optimizers "
        "of one kind (e.g. another chain of transformations)."
      )
    )
  if not only_optimizer:
    return f"It was also written by another optimizer, {_optimizer_words(saved)}; this run's is {here}."
  return (
    f"Only the optimizer state differs: it was written by the optimizer {_optimizer_words(saved)}, and "
    f"this run's is {here}."
  )


def _flag_value(value) -> str:
  if isinstance(value, list):
    return "(" + ",".join(str(v) for v in value) + ("," if len(value) == 1 else "") + ")"
  return repr(value) if isinstance(value, str) else str(value)

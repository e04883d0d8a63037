"""Files written whole or not at all, and the checkpoints' own account of theirs (``checkpoints/<step>/files.json``):
the one reader of which checkpoint is whole, for resuming (``runtime.checkpoint``) and for starting from another
run's (``spmd.pretrained``)."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Optional


def write_atomic(path: str, data: bytes | str) -> None:
  """Writes ``path`` through a temporary file and a rename, so a crash never leaves it half-written."""
  directory = os.path.dirname(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data.encode() if isinstance(data, str) else data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    try:
      os.remove(tmp)
    except OSError:
      pass
    raise


FILE_LIST = "files.json"  # in each checkpoint: {relative path: size in bytes} of its files, once committed
_METADATA_FILES = ("meta/metadata", "state/_METADATA")  # what a checkpoint without FILE_LIST must parse


def checkpoint_steps(directory: str) -> list[int]:
  """The complete checkpoints in ``directory`` (orbax renames a save to its step number when it is complete),
  ascending."""
  if not os.path.isdir(directory):
    return []
  return sorted(int(n) for n in os.listdir(directory) if n.isdigit() and os.path.isdir(os.path.join(directory, n)))


def list_files(path: str) -> dict[str, int]:
  """``{relative path: size}`` of every file under ``path`` but ``FILE_LIST`` (and NFS's ``.nfs*`` files)."""
  out = {}
  for root, _, files in os.walk(path):
    for f in files:
      rel = os.path.relpath(os.path.join(root, f), path)
      if rel != FILE_LIST and not f.startswith(".nfs"):
        out[rel] = os.path.getsize(os.path.join(root, f))
  return out


def damage(path: str) -> Optional[str]:
  """Why the checkpoint at ``path`` is not what was written, from its files alone; ``None``: it looks whole."""
  listed, written = os.path.join(path, FILE_LIST), None
  if os.path.isfile(listed):
    try:
      with open(listed) as f:
        written = json.load(f)
    except (OSError, ValueError):
      written = None  # the list itself damaged: judged as a checkpoint without one
  if isinstance(written, dict):
    for rel, size in sorted(written.items()):
      full = os.path.join(path, rel)
      if not os.path.isfile(full):
        return f"{rel} is missing"
      if os.path.getsize(full) != size:
        return f"{rel} holds {os.path.getsize(full)} bytes, written as {size} (truncated or changed)"
    return None
  for rel in _METADATA_FILES:  # no list: a checkpoint cut off right after its commit
    try:
      with open(os.path.join(path, rel)) as f:
        json.load(f)
    except (OSError, ValueError) as e:
      return f"{rel} cannot be read ({type(e).__name__})"
  return None


def newest_whole(directory: str) -> tuple[Optional[int], dict[int, str]]:
  """``(step, damaged)``: the newest checkpoint in ``directory`` that ``damage`` finds whole (None: none is), and
  why each newer one is not."""
  damaged = {}
  for step in reversed(checkpoint_steps(directory)):
    why = damage(os.path.join(directory, str(step)))
    if why is None:
      return step, damaged
    damaged[step] = why
  return None, damaged

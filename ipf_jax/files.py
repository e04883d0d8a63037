"""Files written whole or not at all."""

from __future__ import annotations

import os
import tempfile


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

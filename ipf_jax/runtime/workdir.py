"""The run's directory: creation, the one-run-per-workdir lock, atomic writes, free-space reports.

Writers (training) create the workdir and hold its lock for the run's life;
readers (``--eval_only``, the report) need an existing run and create nothing
but their own result files.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import os
import re
import shutil
import socket

LOCK_FILE = ".lock"


class WorkdirError(OSError):
  """The workdir cannot be used; the message says why and what to do."""


def refuse_remote(workdir: str) -> None:
  """A URL (``gs://``, ``s3://``, ``ram://``, ...) is refused with one error: the lock (``flock``), the atomic
  renames, the free-space checks and the log files need a POSIX filesystem. A bucket mounted as one (gcsfuse)
  works; orbax alone could write there, the rest of the run could not."""
  scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", workdir)
  if scheme:
    raise WorkdirError(
      f"--workdir {workdir}: {scheme.group(1)}:// paths are not supported: the run's lock (flock), atomic "
      "renames and log files need a POSIX filesystem; use a local disk, NFS, or the bucket mounted as a "
      "filesystem (e.g. gcsfuse), and choose a --workdir there"
    )


def _require_parent(workdir: str) -> str:
  parent = os.path.dirname(os.path.abspath(workdir))
  if not os.path.isdir(parent):
    raise WorkdirError(
      f"--workdir {workdir}: the parent directory {parent} does not exist; create it first or choose another --workdir"
    )
  return parent


def _not_writable(workdir: str) -> WorkdirError:
  return WorkdirError(
    f"--workdir {workdir}: is not a writable directory; fix its permissions or choose another --workdir"
  )


def _refuse_file(workdir: str) -> None:
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise WorkdirError(f"--workdir {workdir}: is a file, not a directory; choose another --workdir")


def prepare(workdir: str) -> None:
  """Creates ``workdir`` (its parent must exist) and checks that it is a writable directory."""
  refuse_remote(workdir)
  _require_parent(workdir)
  _refuse_file(workdir)
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:
    raise WorkdirError(f"--workdir {workdir}: cannot be created ({e.strerror}); choose a writable location") from None
  if not os.access(workdir, os.W_OK | os.X_OK) or not os.path.isdir(workdir):
    raise _not_writable(workdir)


def check(workdir: str) -> None:
  """``prepare``'s checks without creating anything (``--dry_run``)."""
  refuse_remote(workdir)
  _refuse_file(workdir)
  if os.path.exists(workdir):
    if not os.path.isdir(workdir) or not os.access(workdir, os.W_OK | os.X_OK):
      raise _not_writable(workdir)
    return
  parent = _require_parent(workdir)
  if not os.access(parent, os.W_OK | os.X_OK):
    raise WorkdirError(f"--workdir {workdir}: cannot be created in {parent} (not writable); choose a writable location")


def require_existing(workdir: str, what: str) -> None:
  """For readers: ``workdir`` must already hold a run (nothing is created)."""
  refuse_remote(workdir)
  if not os.path.isdir(workdir):
    raise WorkdirError(
      f"{what}: --workdir {workdir} does not exist; train first with this --workdir, or point "
      "--workdir at an existing run"
    )


class Lock:
  """An exclusive OS lock (``flock``) on ``WORKDIR/.lock`` for one run's life.

  The kernel releases it when the holding process exits for any reason
  (SIGKILL included), so a killed run never blocks the next one. The file
  holds the holder's host, pid and start time, read back to name it when a
  second run is refused. (On network filesystems ``flock`` is only as good
  as the filesystem's lock support.)
  """

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, LOCK_FILE)
    self._file = None

  def _lock(self, f, how: int) -> None:
    """``flock(f, how)`` without waiting, or (``f`` closed) the ``WorkdirError`` naming the run that holds it."""
    try:
      fcntl.flock(f, how | fcntl.LOCK_NB)
    except OSError as e:
      if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
        f.seek(0)
        error = WorkdirError(
          f"--workdir {os.path.dirname(self.path)} is in use by another run "
          f"({f.read().strip() or 'an unknown process'}); wait for it to finish or stop it, or "
          "use another --workdir"
        )
      else:
        error = WorkdirError(f"cannot lock {self.path} ({e.strerror})")
      f.close()
      raise error from None

  def acquire(self) -> None:
    f = open(self.path, "a+")  # never truncate before holding the lock: the holder's line is in it
    self._lock(f, fcntl.LOCK_EX)
    f.seek(0)
    f.truncate()
    f.write(
      f"pid {os.getpid()} on host {socket.gethostname()}, started "
      f"{datetime.datetime.now().isoformat(timespec='seconds')}\n"
    )
    f.flush()
    self._file = f

  def probe(self) -> None:
    """Raises the ``WorkdirError`` ``acquire`` would when another run holds the lock; creates nothing."""
    if not os.path.exists(self.path):
      return
    f = open(self.path)
    self._lock(f, fcntl.LOCK_SH)
    fcntl.flock(f, fcntl.LOCK_UN)
    f.close()

  def release(self) -> None:
    if self._file is not None:
      fcntl.flock(self._file, fcntl.LOCK_UN)
      self._file.close()
      self._file = None


def free_space(path: str) -> str:
  """``"12.3 MiB free of 3.0 GiB"`` on the filesystem holding ``path``."""
  while path and not os.path.exists(path):
    path = os.path.dirname(path)
  try:
    usage = shutil.disk_usage(path or ".")
  except OSError:
    return "free space unknown"
  return f"{size_text(usage.free)} free of {size_text(usage.total)}"


def size_text(n: float) -> str:
  """``1536`` -> ``"1.5 KiB"``."""
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if n < 1024 or unit == "TiB":
      return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
    n /= 1024
  return ""

"""The ``ipf_jax`` logger's destinations: progress to stdout and, for an accepted training run, the workdir's
``train.log`` (process 0 only)."""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys
from typing import Optional

import jax

log = logging.getLogger("ipf_jax")


class _LogFile(logging.FileHandler):
  """``train.log``; a write that fails (full disk) is reported once, then the file is dropped, not the run."""

  def handleError(self, record):
    err = sys.exc_info()[1]
    log.removeHandler(self)
    print(
      f"warning: cannot write {self.baseFilename} ({getattr(err, 'strerror', None) or err}); progress goes "
      "to stdout only",
      file=sys.stderr,
      flush=True,
    )


def setup_logging(workdir: Optional[str]) -> None:
  """Progress to stdout and, for a training run, ``workdir/train.log`` (process 0 only).

  ``train.log`` is opened by ``keep_log(workdir)`` once the run is accepted (its checkpoint fits);
  what was logged before is held until then, so a refused run leaves the file as it was.
  """
  log.setLevel(logging.INFO)
  log.propagate = False
  for h in list(log.handlers):
    log.removeHandler(h)
    h.close()
  if jax.process_index() != 0:
    log.addHandler(logging.NullHandler())
    return
  fmt = logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S")
  handlers = [logging.StreamHandler(sys.stdout)]
  if workdir:
    handlers.append(logging.handlers.MemoryHandler(capacity=10_000, flushLevel=logging.CRITICAL + 1))
  for h in handlers:
    h.setFormatter(fmt)
    log.addHandler(h)


def keep_log(workdir: str) -> None:
  """Opens ``workdir/train.log`` and writes to it what was held back (see ``setup_logging``)."""
  for h in list(log.handlers):
    if isinstance(h, logging.handlers.MemoryHandler):
      file_handler = _LogFile(os.path.join(workdir, "train.log"))
      file_handler.setFormatter(h.formatter)
      h.setTarget(file_handler)
      h.flush()
      log.removeHandler(h)
      log.addHandler(file_handler)

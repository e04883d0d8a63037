"""orbax's stderr noise around a failure the run reports in one line: a failed restore's leftover
tracebacks (``contained_stderr``, ``settle``) and a failed background save's (``Quarantine``)."""
from __future__ import annotations

import contextlib
import gc
import io
import sys
import time


@contextlib.contextmanager
def contained_stderr():
  """Holds back what orbax prints while a restore fails (see ``settle``)."""
  stderr, hook = sys.stderr, sys.unraisablehook
  sys.stderr, sys.unraisablehook = io.StringIO(), lambda *args: None
  try:
    yield
  finally:
    sys.stderr, sys.unraisablehook = stderr, hook


def settle(seconds: float = 2.0) -> None:
  """Lets a failed restore's leftovers finish inside ``contained_stderr``.

  orbax gathers one TensorStore read per array; when one fails, the others
  finish on an event loop that is already closed and each prints a traceback
  from TensorStore's threads, and each abandoned coroutine an "Exception
  ignored" when collected: thousands of lines for one damaged file, where the
  run reports one.
  """
  time.sleep(seconds)
  gc.collect()


_QUIET_BACKGROUND_FAILURES = [False]


def quiet_background_failures(enabled: bool = True) -> None:
  """The command line's choice (``cli.main``): hold stderr back while a background save is in flight
  (see ``Quarantine``). Off for library use: a notebook or script keeps its stderr as it is."""
  _QUIET_BACKGROUND_FAILURES[0] = enabled


class Quarantine:
  """stderr held back while a background save is in flight (command-line runs only).

  When a save fails (a full disk), orbax's remaining writers each print a
  traceback from their threads, and each abandoned coroutine another when it
  is collected: thousands of lines around the one the run reports. While a
  save is in flight, stderr goes to a buffer; once it is committed the buffer
  is written out (nothing is lost, only delayed); if it fails, the buffer and
  everything after it are dropped, and the run's own messages go to stdout and
  ``sys.__stderr__``. Where something else already owns ``sys.stderr`` (a
  notebook, pytest), nothing is changed.
  """

  def __init__(self):
    self._buffer = None

  def begin(self) -> None:
    if self._buffer is None and _QUIET_BACKGROUND_FAILURES[0] and sys.stderr is sys.__stderr__:
      self._buffer = io.StringIO()
      sys.stderr = self._buffer

  def release(self) -> None:
    if self._buffer is not None and sys.stderr is self._buffer:
      sys.stderr = sys.__stderr__
      sys.stderr.write(self._buffer.getvalue())
    self._buffer = None

  def keep(self) -> None:
    """For good: the rest of the process's stderr is dropped (the command line prints its last line to
    ``sys.__stderr__``)."""
    if self._buffer is None and _QUIET_BACKGROUND_FAILURES[0] and sys.stderr is sys.__stderr__:
      self._buffer = io.StringIO()
      sys.stderr = self._buffer
    if self._buffer is not None:
      sys.unraisablehook = lambda *args: None

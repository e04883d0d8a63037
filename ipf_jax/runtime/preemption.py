"""Stopping a run cleanly at a step every process agrees on (DESIGN.md "Durability").

A run stops early, saves and exits with a documented code when it sees:

- SIGTERM (how Cloud TPU spot VMs, SLURM and Kubernetes preempt) or SIGINT
  (Ctrl-C; a second Ctrl-C stops at once, without saving);
- ``config.time_limit_minutes`` of wall time.

``config.checkpoint_every_minutes`` adds wall-clock saves for sessions that end
without a signal (Colab). The decisions are taken at step boundaries:

- one process: signal handlers set a flag that the loop reads after each step;
- several processes (``jax.distributed``): JAX's preemption sync point, which
  hears SIGTERM on any process and names one step at which every process
  stops (SIGINT is turned into SIGTERM for it); the clock is read by process 0
  at log steps and broadcast, so every process saves and stops at one step.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from typing import Optional

import jax
import numpy as np

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_PEER = 69  # a peer process did not start or stopped answering (sysexits EX_UNAVAILABLE)
EXIT_TIME_LIMIT = 75  # stopped at config.time_limit_minutes; rerun to resume (sysexits EX_TEMPFAIL)
EXIT_SIGINT = 128 + signal.SIGINT  # 130
EXIT_SIGTERM = 128 + signal.SIGTERM  # 143


@dataclasses.dataclass(frozen=True)
class Stop:
  """Why a run stops before its last step."""

  reason: str
  exit_code: int


class RunStopped(Exception):
  """The run stopped early after saving (or with nothing new to save); ``exit_code`` for the CLI."""

  def __init__(self, message: str, exit_code: int):
    super().__init__(message)
    self.exit_code = exit_code


def _say(message: str) -> None:
  # os.write is safe inside a signal handler (print and logging take locks the main thread may hold).
  try:
    os.write(1, (message + "\n").encode())
  except OSError:
    pass


class StopControl:
  """Signal handlers and clocks of one run; ``with StopControl(...) as control:`` around the loop.

  Args:
    time_limit_minutes: stop (and save) after this much wall time; 0 = none.
    checkpoint_every_minutes: ask for a save when this much wall time passed since the last one; 0 = none.
  """

  def __init__(self, time_limit_minutes: float = 0.0, checkpoint_every_minutes: float = 0.0):
    self.time_limit_s = 60.0 * time_limit_minutes
    self.checkpoint_every_s = 60.0 * checkpoint_every_minutes
    self.multiprocess = jax.process_count() > 1
    self._signal: Optional[int] = None
    self._previous = {}
    self._start = time.monotonic()
    self._last_save = self._start

  # ---- signals ---------------------------------------------------------------------------------
  def __enter__(self) -> "StopControl":
    wanted = [signal.SIGINT] if self.multiprocess else [signal.SIGINT, signal.SIGTERM]
    try:
      for sig in wanted:  # several processes: SIGTERM stays with JAX's preemption notifier
        self._previous[sig] = signal.signal(sig, self._handle)
    except ValueError:  # not the main thread (library use): no handlers, the clocks still work
      self._previous = {}
    return self

  def __exit__(self, *exc) -> None:
    for sig, previous in self._previous.items():
      signal.signal(sig, previous)
    self._previous = {}

  def _handle(self, signum, frame) -> None:
    if self._signal == signal.SIGINT and signum == signal.SIGINT:
      raise KeyboardInterrupt  # a second Ctrl-C: stop at once
    if self._signal is None:
      name = signal.Signals(signum).name
      _say(
        f"{name} received: finishing the step in flight, then saving a checkpoint and stopping"
        + (" (Ctrl-C again to stop at once, without saving)" if signum == signal.SIGINT else "")
      )
      self._signal = signum
      if self.multiprocess:
        os.kill(os.getpid(), signal.SIGTERM)  # JAX's preemption notifier listens for SIGTERM

  @property
  def signalled(self) -> bool:
    """A signal arrived at this process (single-process runs stop evaluations early on it)."""
    return self._signal is not None

  def signal_stop(self) -> Optional[Stop]:
    """The stop this process's own signal asks for, if one arrived."""
    if self._signal is None:
      return None
    return Stop(signal.Signals(self._signal).name, EXIT_SIGINT if self._signal == signal.SIGINT else EXIT_SIGTERM)

  # ---- decisions at step boundaries --------------------------------------------------------------
  def saved(self) -> None:
    """Restarts the ``checkpoint_every_minutes`` clock."""
    self._last_save = time.monotonic()

  def at_step(self, step: int, log_step: bool) -> tuple[Optional[Stop], bool]:
    """``(stop, save_now)`` after ``step``, the same on every process.

    ``stop`` is set when a signal, preemption notice or the time limit says so;
    ``save_now`` when ``checkpoint_every_minutes`` have passed since the last save.
    Clocks are read at log steps only, so that several processes can agree cheaply.
    """
    stop = None
    if self.multiprocess:
      from jax.experimental import multihost_utils

      if multihost_utils.reached_preemption_sync_point(step):
        stop = Stop("SIGINT" if self._signal == signal.SIGINT else "SIGTERM (a preemption notice)", EXIT_SIGTERM)
    else:
      stop = self.signal_stop()
    save_now = False
    if log_step and (self.time_limit_s or self.checkpoint_every_s):
      now = time.monotonic()
      flags = np.array(
        [
          bool(self.time_limit_s) and now - self._start >= self.time_limit_s,
          bool(self.checkpoint_every_s) and now - self._last_save >= self.checkpoint_every_s,
        ]
      )
      if self.multiprocess:
        from jax.experimental import multihost_utils

        flags = np.asarray(multihost_utils.broadcast_one_to_all(flags))  # process 0's clock decides
      if flags[0] and stop is None:
        stop = Stop(f"time_limit_minutes={self.time_limit_s / 60:g}", EXIT_TIME_LIMIT)
      save_now = bool(flags[1])
    return stop, save_now

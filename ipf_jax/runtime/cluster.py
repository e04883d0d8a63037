"""Multi-process start-up and peer health (``jax.distributed``), with bounded, named failures.

``start(...)`` joins the processes of a multi-host run: explicitly (coordinator
address, process count and id) or as ``jax.distributed.initialize()`` detects
them (SLURM, Open MPI, Cloud TPU pods, GKE, ...). Two failures that JAX
reports with a C++ abort after minutes end here within a bounded time with
one line naming the coordinator and what is missing:

- a process that never starts: after ``startup_timeout`` seconds;
- a process that dies or hangs later: each process posts a heartbeat to the
  coordination service's key-value store, and a watcher thread ends this
  process when a peer has been silent for ``peer_timeout`` seconds, when a
  peer reports an error, or when the coordinator (process 0) is gone.

JAX's own heartbeat timeout is set above ``peer_timeout`` so that this line
comes first. Exit code: ``preemption.EXIT_PEER`` (69).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from typing import Optional

import jax

from ipf_jax.runtime.preemption import EXIT_PEER

_PREFIX = "ipf_jax/peer/"
_DONE = "done"
_FAILED = "failed:"


def _die(message: str) -> None:
  """One line on stderr, then exit without running atexit hooks (JAX's shutdown would wait for the dead peer)."""
  try:
    sys.stdout.flush()
  except Exception:  # noqa: BLE001
    pass
  os.write(2, f"error: {message}\n".encode())
  os._exit(EXIT_PEER)


def start(
  coordinator_address: Optional[str] = None,
  num_processes: Optional[int] = None,
  process_id: Optional[int] = None,
  startup_timeout: int = 300,
  peer_timeout: int = 60,
) -> Optional["PeerWatch"]:
  """Starts ``jax.distributed`` for a multi-process run; returns its ``PeerWatch``, or ``None`` for one process.

  Without ``coordinator_address`` the launcher is detected by
  ``jax.distributed.initialize()``; when it detects none, the run is single-process.
  """
  # CPU hosts talk over gloo (GPU and TPU backends bring their own collectives).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  where = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS") or "the detected coordinator"
  if coordinator_address:
    print(
      f"joining {num_processes} processes as process {process_id} through the coordinator at "
      f"{coordinator_address} (waiting up to {startup_timeout} s: --startup_timeout)",
      flush=True,
    )
  timer = threading.Timer(
    startup_timeout,
    _die,
    args=(
      f"not every process of the run connected to the coordinator at {where} within {startup_timeout} s "
      "(--startup_timeout). Start every process with the same --coordinator_address and --num_processes and "
      "its own --process_id (process 0 hosts the coordinator), check that the address is reachable from "
      "each host, then run again.",
    ),
  )
  timer.daemon = True
  timer.start()
  try:
    jax.distributed.initialize(
      coordinator_address,
      num_processes,
      process_id,
      initialization_timeout=startup_timeout + 60,
      heartbeat_timeout_seconds=peer_timeout + 60,
    )
  except ValueError as e:
    if coordinator_address is None and str(e) == "coordinator_address should be defined.":
      return None  # no launcher detected: one process
    raise
  finally:
    timer.cancel()
  if jax.process_count() == 1:
    return None
  from jax._src import distributed  # the coordination service's key-value store (no public API)

  watch = PeerWatch(
    distributed.global_state.client,
    jax.process_index(),
    jax.process_count(),
    peer_timeout,
    distributed.global_state.coordinator_address or where,
  )
  watch.start()
  return watch


class PeerWatch:
  """Heartbeats through the coordination service; ends this process when a peer is lost.

  Every ``interval`` seconds each process writes a counter under
  ``ipf_jax/peer/<id>`` and reads the others'. A peer whose counter has not
  moved for ``timeout`` seconds (as seen by this process's clock) is lost.
  """

  def __init__(self, client, process_id: int, num_processes: int, timeout: float, address: str):
    self.client, self.me, self.n, self.timeout, self.address = client, process_id, num_processes, timeout, address
    self.interval = max(0.5, min(5.0, timeout / 6))
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="ipf_jax-peers", daemon=True)
    self._hosts: dict = {}

  def start(self) -> None:
    self.client.key_value_set(f"ipf_jax/host/{self.me}", socket.gethostname(), allow_overwrite=True)
    self._thread.start()

  def _host(self, pid: int) -> str:
    if pid not in self._hosts:
      try:
        self._hosts[pid] = self.client.key_value_try_get(f"ipf_jax/host/{pid}")
      except Exception:  # noqa: BLE001
        return "unknown host"
    return self._hosts[pid]

  def _run(self) -> None:
    beats, last_value, last_change = 0, {}, {}
    started = time.monotonic()
    while not self._stop.wait(self.interval if beats else 0):
      beats += 1
      try:
        self.client.key_value_set(f"{_PREFIX}{self.me}", str(beats), allow_overwrite=True)
        values = dict(self.client.key_value_dir_get(_PREFIX))
      except Exception as e:  # noqa: BLE001
        if self._stop.is_set():
          return
        _die(
          f"lost the coordinator at {self.address} (process 0): {str(e).splitlines()[0][:200]}. This process "
          f"({self.me} of {self.n}) stops; the newest checkpoint is kept. Rerun every process with the same "
          "command to resume."
        )
      now = time.monotonic()
      for pid in range(self.n):
        if pid == self.me:
          continue
        value = values.get(f"{_PREFIX}{pid}")
        if value == _DONE:
          continue
        if value is not None and value.startswith(_FAILED):
          _die(
            f"process {pid} of {self.n} ({self._host(pid)}) stopped with an error: {value[len(_FAILED) :]}. "
            f"This process ({self.me}) stops too; fix the cause, then rerun every process."
          )
        if value != last_value.get(pid):
          last_value[pid], last_change[pid] = value, now
        if now - last_change.get(pid, started) > self.timeout:
          _die(
            f"process {pid} of {self.n} ({self._host(pid)}) has not answered for {self.timeout:g} s "
            f"(--peer_timeout; coordinator {self.address}): it died or hangs. This process ({self.me}) stops; "
            "the newest checkpoint is kept. Rerun every process with the same command to resume."
          )

  def fail(self, error: BaseException) -> None:
    """Ends this process after an error nobody caught: one line, the peers told, no waiting at exit.

    (JAX's exit handler would wait in a shutdown barrier for a peer that may be gone.)
    """
    text = " ".join(str(error).split())[:300]
    peer = any(m in text for m in ("Gloo", "gloo", "Connection", "connection", "UNAVAILABLE", "DEADLINE_EXCEEDED"))
    self.finish(f"{type(error).__name__}: {text}")
    if peer:
      _die(
        f"a collective with the other processes failed ({text}): a peer process died or lost its connection "
        f"(coordinator {self.address}). This process ({self.me} of {self.n}) stops; the newest checkpoint is kept. "
        "Rerun every process with the same command to resume."
      )
    import traceback

    traceback.print_exception(error, file=sys.stderr)
    _die(
      f"process {self.me} of {self.n} stopped on an unexpected {type(error).__name__} (traceback above); the "
      "other processes are told to stop."
    )

  def finish(self, error: Optional[str] = None) -> None:
    """Stops watching and tells the peers this process ended: cleanly, or with ``error``."""
    self._stop.set()
    self._thread.join(timeout=2 * self.interval + 5)
    try:
      value = _DONE if error is None else _FAILED + " " + error.replace("\n", " ")[:300]
      self.client.key_value_set(f"{_PREFIX}{self.me}", value, allow_overwrite=True)
    except Exception:  # noqa: BLE001 - the coordinator may already be gone
      pass

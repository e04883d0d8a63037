"""TensorBoard event files in the workdir (process 0 only), via tensorboardX.

Scalar tags (read back by ``ipf_jax.reporting.report``):
  train/loss, train/lr, train/ess, train/max_weight, train/resamples, train/num_alive,
  train/grad_norm, train/images_per_s, train/diversity,
  particle/loss/<i>, particle/weight/<i>, particle/diversity/<i>,
  resample/event (1 at a step that resampled), resample/ancestor/<slot> (at those steps),
  train/loss_scale, train/overflow (float16 only: the step's loss scale, 1 if its gradient overflowed),
  eval/<model>/<metric> (classification: accuracy, nll, ece; Gaussian regression: nll, rmse, ...) with
  model = ensemble, ensemble_uniform, fused, fused_bn (when fused_bn_batches > 0), particle_<i>.
"""

from __future__ import annotations

import os
import sys
import time

import jax
import numpy as np
from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto.event_pb2 import Event
from tensorboardX.proto.summary_pb2 import Summary

from ipf_jax.evaluation import metrics as metrics_lib
from ipf_jax.reporting import trackers as trackers_lib


class SummaryWriter:
  """Writes nothing on processes other than 0.

  Events are written synchronously (tensorboardX's ``EventsWriter``, one event
  per step) rather than by tensorboardX's background thread, which dies on a
  full disk and then blocks the caller forever once its queue fills. A write
  that fails is reported once; training goes on without events.
  """

  def __init__(self, workdir: str, flush_secs: float = 30.0, trackers=("tensorboard",), config=None):
    """``trackers``: ``config.trackers`` parsed; MLflow and W&B sinks get every scalar too (``reporting.trackers``)."""
    self._writer, self.sinks = None, []
    self._flush_secs, self._last_flush = flush_secs, time.monotonic()
    if jax.process_index() == 0:
      self.sinks = trackers_lib.open_sinks(trackers, workdir, config or {})
    if jax.process_index() == 0 and "tensorboard" in trackers:
      self._guard(
        lambda: setattr(
          self, "_writer", EventsWriter(os.path.join(workdir, "events"), filename_suffix=f".{os.getpid()}")
        ),
        workdir,
      )

  def _guard(self, fn, where: str = "") -> None:
    try:
      fn()
    except OSError as e:
      self._writer = None
      print(
        f"warning: cannot write TensorBoard events{' in ' + where if where else ''} "
        f"({e.strerror or e}); training goes on without them",
        file=sys.stderr,
        flush=True,
      )

  def scalars(self, step: int, values: dict) -> None:
    finite = {tag: float(v) for tag, v in values.items() if np.isfinite(float(v))}
    for sink in self.sinks:
      sink.scalars(step, finite)
    if self._writer is None:
      return
    summary = Summary(value=[Summary.Value(tag=tag, simple_value=v) for tag, v in finite.items()])
    event = Event(summary=summary, step=int(step), wall_time=time.time())
    self._guard(lambda: self._writer.write_event(event))
    if self._writer is not None and time.monotonic() - self._last_flush > self._flush_secs:
      self.flush()

  def train_step(self, step: int, m: dict) -> None:
    """One step's metrics (host numpy ``m`` from the train step, its learning rate ``lr`` included)."""
    if self._writer is None and not self.sinks:
      return
    w = np.exp(m["log_weights"])
    alive = m["alive"] > 0
    values = {
      "train/loss": metrics_lib.weighted_train_loss(m),
      "train/lr": m.get("lr", np.nan),
      "train/ess": m["ess"],
      "train/max_weight": w.max(),
      "train/num_alive": m["num_alive"],
      "train/grad_norm": np.mean(m["grad_norm"][alive]) if alive.any() else np.nan,
      "resample/event": float(m["resampled"]),
    }
    if "loss_scale" in m:
      values.update({"train/loss_scale": m["loss_scale"], "train/overflow": float(m["overflow"])})
    if "temperature" in m:
      values["train/temperature"] = m["temperature"]
    for i in range(len(w)):
      values[f"particle/loss/{i}"] = m["loss"][i]
      values[f"particle/weight/{i}"] = w[i]
    if m["resampled"]:
      for slot, a in enumerate(m["ancestors"]):
        values[f"resample/ancestor/{slot}"] = a
    self.scalars(step, values)

  def eval_results(self, step: int, results: dict) -> None:
    """``eval/<row>/<metric>`` for every scalar metric of every row (and of each shifted set,
    ``eval/shifts/<set>/<row>/<metric>``; OOD AUROC, ``eval/ood/<row>/<metric>``);
    ``eval/particle_<i>/<metric>``. Curves and histograms stay in ``eval_results.json``."""
    values = {}

    def walk(prefix, tree):
      for key, v in tree.items():
        if key == "particles":
          continue
        if isinstance(v, dict):
          walk(f"{prefix}/{key}", v)
        elif isinstance(v, (int, float, np.number, np.ndarray)) and np.ndim(v) == 0:
          values[f"{prefix}/{key}"] = v
      for metric, v in tree.get("particles", {}).items():
        if np.ndim(v) == 1:
          values.update({f"{prefix}/particle_{i}/{metric}": x for i, x in enumerate(v)})

    walk("eval", {k: v for k, v in results.items() if k != "weights"})
    self.scalars(step, values)

  def flush(self) -> None:
    if self._writer is not None:
      self._guard(self._writer.flush)
      self._last_flush = time.monotonic()

  def artifacts(self, paths: list) -> None:
    """Files of the run (the fused model, results, pictures) to the trackers that keep artifacts."""
    for sink in self.sinks:
      sink.artifacts([p for p in paths if os.path.isfile(p)])

  def close(self, finished: bool = False) -> None:
    for sink in self.sinks:
      sink.close(finished)
    self.sinks = []
    if self._writer is not None:
      self._guard(self._writer.close)
      self._writer = None

"""The step loop of a run (``Training``): batches in, steps, progress lines with their ETA, periodic saves
and evaluations, and the stop the preemption control agrees on. ``trainer`` assembles the run it loops over."""

from __future__ import annotations

import logging
import math
import time
from typing import Optional

import jax
import numpy as np
from jax.experimental import multihost_utils

from ipf_jax.data.errors import DataError
from ipf_jax.evaluation import metrics as metrics_lib
from ipf_jax.runtime import checkpoint as checkpoint_lib
from ipf_jax.runtime import rewind as rewind_lib
from ipf_jax.spmd import layout, outer_step
from ipf_jax.spmd.mesh import one_program_at_a_time

log = logging.getLogger("ipf_jax")


class NonFiniteError(FloatingPointError):
  """Every particle's loss or gradient became non-finite."""


def fmt_time(seconds: float) -> str:
  if not np.isfinite(seconds):
    return "--"
  seconds = int(max(seconds, 0))
  return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def check_finite(state, num_particles: int, step: int, newest: Optional[int]) -> int:
  """Number of skipped (non-finite) steps; with several particles, any is fatal."""
  skipped = int(state.num_skipped)
  if skipped and num_particles > 1:
    kept = (
      f"the newest checkpoint (step {newest}) is kept" if newest is not None else "no checkpoint had been written yet"
    )
    raise NonFiniteError(
      f"step {step}: every particle's loss or gradient is non-finite. The update was skipped "
      f"and no checkpoint was written after it; {kept}. Lower config.base_lr or set "
      "config.grad_clip_norm, then run again" + (" to resume." if newest is not None else ".")
    )
  return skipped


class Training:
  """The step loop of one run. ``run_steps()`` trains until the last step or an agreed stop and returns the
  stop (or None); a failed save raises ``SaveError`` where it happens, after abandoning the checkpointer.
  ``state`` and ``newest`` (the newest saved step) are the loop's, for its caller to read after either."""

  def __init__(self, run, control, ckpt, writer, state, newest, interrupted, step_hook, watch=None):
    self.run, self.control, self.ckpt, self.writer = run, control, ckpt, writer
    self.state, self.newest, self.interrupted, self.step_hook = state, newest, interrupted, step_hook
    self.start = int(state.step)
    self.watch: Optional[rewind_lib.Watch] = watch  # config.rewind; None: off
    if watch is not None:  # a resumed run trains at the rate its rewinds left (config.rewind_lr_factor)
      run.parts = run.parts.with_lr_factor(watch.lr_scale)

  @property
  def judging(self) -> bool:
    """Whether rewind judges this run's losses and evaluations (``config.rewind``; a disabled watch only keeps a
    resumed run's data offset)."""
    return self.watch is not None and self.watch.enabled

  def run_steps(self):
    t_start = time.perf_counter()
    self._clock = (t_start, self.start)  # (time, step) of the last progress line
    while True:
      try:
        stop = self._steps_from(int(self.state.step))
        break
      except rewind_lib.Rewind as due:
        self._rewind(due)
    if self.ckpt is not None:
      self._saving(int(self.state.step), self.ckpt.close)  # the newest checkpoint is committed before anything else
    self.writer.flush()
    done, elapsed = int(self.state.step), time.perf_counter() - t_start
    if done > self.start:
      log.info(
        "trained %d steps in %s (%.1f steps/s)",
        done - self.start,
        fmt_time(elapsed),
        (done - self.start) / max(elapsed, 1e-9),
      )
    return stop

  def _steps_from(self, start: int):
    """Steps from ``start`` to the end or an agreed stop (returned); raises ``Rewind`` when one is due."""
    run, config, watch = self.run, self.run.config, self.watch
    pending = []  # per-step metrics still on the device, fetched at the next log step
    stop = None
    offset = watch.data_offset if watch is not None else 0  # batches skipped by rewinds
    prefetched = layout.prefetch(
      run.dataset.train_batches(start + offset, config.global_batch_size, config.seed),
      lambda b: layout.put_train_batch(b, run.parts.spec.num_particles, run.parts.mesh, run.dataset.process_local),
    )
    batches = until_exhausted(prefetched, run.dataset.name, start)
    try:
      for step in range(start, run.parts.total_steps):
        batch = next(batches)
        if self.step_hook is not None:
          self.state, batch = self.step_hook(step, self.state, batch)
        self.state, m = one_program_at_a_time(run.parts.step_at(step)(self.state, batch))
        pending.append(m)
        done = step + 1
        log_step = done % config.log_every_steps == 0 or done == run.parts.total_steps
        if log_step:
          self._log(done, fetch(pending))
          pending = []
        stop, save_now = self.control.at_step(done, log_step)
        if self.judging and stop is None:  # judged before any save and evaluation
          periodic = config.checkpoint_every_steps > 0 and done % config.checkpoint_every_steps == 0
          if pending and (periodic or save_now):
            self._log(done, fetch(pending), progress=False)
            pending = []
          self._evaluate_if_due(done)
        self._save_if_due(done, save_now, stop is not None)
        if stop is not None:
          break
        if not self.judging:
          self._evaluate_if_due(done)
    finally:
      prefetched.close()
    return stop

  def _rewind(self, due: rewind_lib.Rewind) -> None:
    """Back to the newest checkpoint (``DivergedError`` without one, or past ``rewind_max``)."""
    if self.ckpt is None or self.newest is None:
      raise rewind_lib.DivergedError(f"step {due.step}: {due.reason}, and no checkpoint was written to go back to")
    self._saving(due.step, self.ckpt.wait)
    read_to = int(self.state.step)  # the batches up to here were read (the spike is judged at log steps)
    before_spike = lambda meta: not meta.get("rewind", {}).get("above")  # not a stop's save inside a spike
    restored = self.ckpt.restore_latest(
      self.run.parts.abstract_state, self.run.config, self.run.state_signature, wanted=before_spike
    )
    if restored is None:
      raise rewind_lib.DivergedError(f"step {due.step}: {due.reason}, and every checkpoint was saved inside the spike")
    state, _ = restored
    self.watch.rewound(read_to, int(state.step), self.run.config.rewind_max)
    self.run.parts = self.run.parts.with_lr_factor(self.watch.lr_scale)
    self.state, self.newest = state, int(state.step)
    self._clock = (time.perf_counter(), self.newest)  # the next progress line's rate counts from the restore
    log.warning(
      "step %d: %s; rewound to the checkpoint of step %d, skipping the %d batches read since (rewind %d of at most "
      "%d)%s",
      due.step,
      due.reason,
      self.newest,
      read_to - self.newest,
      self.watch.count,
      self.run.config.rewind_max,
      "" if self.watch.lr_factor == 1 else f"; the learning rate is now x{self.watch.lr_scale:g} the schedule's",
    )
    self.writer.scalars(due.step, {"train/rewinds": self.watch.count})

  def _log(self, done: int, fetched: list, progress: bool = True) -> None:
    """The fetched steps' scalars, rewind's judgement of their losses, and (``progress``) the progress line."""
    judged = self.judging
    try:
      skipped = check_finite(self.state, self.run.parts.spec.num_particles, done, self.newest)
    except NonFiniteError as e:
      if not judged:
        raise
      raise rewind_lib.Rewind(done, "every particle's loss or gradient was not finite") from e
    (t_last, last_step), now = self._clock, time.perf_counter()
    for k, mk in enumerate(fetched, start=done - len(fetched) + 1):
      self.writer.train_step(k, mk)
      if judged:  # a step whose every particle was dead or skipped counts as not finite
        alive = int(mk["num_alive"]) > 0
        self.watch.loss(k, float(metrics_lib.weighted_train_loss(mk)) if alive else math.nan)
    if not progress:  # rewind's judgement before a save: the scalars written, the line left to the log step
      return
    log_progress(
      self.run, self.state, fetched[-1], self.writer, done, self.start, (done - last_step) / (now - t_last), skipped
    )
    self._clock = (now, done)

  def _save_if_due(self, done: int, requested: bool, stopping: bool = False) -> None:
    """A background save's failure stops the run at once (``poll``); a save at the last step, a periodic one,
    one the stop control asks for (its timer), or the stop's. With ``rewind``, while the loss is suspect only
    the stop's and the last are made (with a warning)."""
    if self.ckpt is None:
      return
    config = self.run.config
    periodic = config.checkpoint_every_steps and done % config.checkpoint_every_steps == 0
    suspect = self.watch is not None and self.watch.suspect
    held = suspect and not stopping and done != self.run.parts.total_steps
    requested = requested or stopping
    if suspect and not held:
      log.warning(
        "step %d is saved while the training loss is above rewind's line (for %d of rewind_window=%d steps): "
        "this checkpoint may hold a spike%s",
        done,
        self.watch.above,
        self.watch.window,
        "; the resumed run judges it on" if done != self.run.parts.total_steps else "; the run ends here",
      )

    def save():
      self.ckpt.poll()
      last = done == self.run.parts.total_steps
      if (last or periodic or requested) and not held:  # held: the loss is suspect (rewind)
        check_finite(self.state, self.run.parts.spec.num_particles, done, self.newest)
        self.ckpt.save(done, self.state, config, rewind=self.watch.record() if self.watch is not None else None)
        self.control.saved()
        self.newest = done

    self._saving(done, save)

  def _saving(self, step: int, operation) -> None:
    try:
      operation()
    except checkpoint_lib.SaveError as e:
      log.error("stopping at step %d: %s", step, e)
      self.ckpt.abandon()
      self.newest = self.ckpt.latest_step()
      raise

  def _evaluate_if_due(self, done: int) -> None:
    every = self.run.config.eval_every_steps
    if not every or done % every or done == self.run.parts.total_steps:
      return
    evals = self.run.evaluations
    try:
      results = evals.evaluate(self.state, evals.fused_bn(self.state, self.interrupted), self.interrupted)
    except InterruptedError:
      return  # the stop is taken after the next step
    self.writer.eval_results(done, results)
    if self.watch is not None:
      self.watch.accuracy(done, float(results["ensemble"]["accuracy"]))
    log.info(
      "eval step %d  ensemble acc %.2f%%  fused acc %.2f%%",
      done,
      100 * results["ensemble"]["accuracy"],
      100 * results["fused"]["accuracy"],
    )


def fetch(pending: list) -> list:
  """The steps' metrics on the host: replicated ones as they are, the outer loop's per-particle ones (sharded
  over "particle", on several processes not all addressable here) gathered; ``ess`` and ``num_alive`` added
  where a local step could not compute them."""
  local = lambda x: x.is_fully_addressable or x.is_fully_replicated  # device_get reads these as they are
  gather = lambda x: x if local(x) else multihost_utils.process_allgather(x, tiled=True)
  return [outer_step.host_metrics(m) for m in jax.device_get(jax.tree.map(gather, pending))]


def until_exhausted(batches, name: str, start: int):
  """``batches``, with one clear error when the data ends before the run does."""
  step = start
  for batch in batches:
    yield batch
    step += 1
  raise DataError(
    f"the training data {name!r} ended at step {step} ({step - start} batches read): "
    "train_batches(start_step, ...) must give a batch for every step of the run "
    "(config.num_train_steps or num_epochs)"
  )


def log_progress(run, state, m, writer, done: int, start: int, rate: float, skipped: int) -> None:
  """The progress line (stdout and train.log) and the log-step scalars."""
  spec, total, config = run.parts.spec, run.parts.total_steps, run.config
  # A sync step's own (the outer loop's): the particles' distances to the anchor before the sync pulled them in
  distances = np.asarray(m["diversity"] if "diversity" in m else run.parts.diversity(state))
  writer.scalars(
    done,
    {
      "train/images_per_s": rate * config.global_batch_size,
      "train/resamples": int(state.num_resamples),
      "train/diversity": float(np.nanmean(distances)),
      **{f"particle/diversity/{i}": d for i, d in enumerate(distances)},
    },
  )
  w = np.exp(m["log_weights"])
  loss = metrics_lib.weighted_train_loss(m)
  eta = (total - done) / rate if done > start + 1 else float("nan")
  scaling = ""
  if state.dynamic_scale is not None:
    scaling = f"  loss scale {float(state.dynamic_scale.scale):g} (overflows {int(state.num_overflows)})"
  epoch = f"  epoch {done / run.steps_per_epoch:.1f}" if run.steps_per_epoch else ""
  if "temperature" in m:  # ess_target: this step's tau
    scaling += f"  tau {float(m['temperature']):.3g}"
  log.info(
    "step %d/%d%s  loss %.4f  ess %.2f/%d  max_w %.3f  resamples %d  alive %d/%d%s%s  "
    "diversity %.3g  lr %.4g  %.1f steps/s  ETA %s",
    done,
    total,
    epoch,
    loss,
    float(m["ess"]),
    spec.num_particles,
    float(w.max()),
    int(state.num_resamples),
    int(m["num_alive"]),
    spec.num_particles,
    f"  skipped {skipped}" if skipped else "",
    scaling,
    float(np.nanmean(distances)),
    float(m.get("lr", np.nan)),
    rate,
    fmt_time(eta),
  )

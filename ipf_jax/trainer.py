"""``train_and_evaluate(config, workdir)``: the training loop, progress and the final table."""
from __future__ import annotations

import json
import logging
import os
import sys
import time

import jax
import ml_collections
import numpy as np

from ipf_jax import checkpoint as checkpoint_lib
from ipf_jax import configuration
from ipf_jax import export
from ipf_jax import mesh as mesh_lib
from ipf_jax import metrics as metrics_lib
from ipf_jax import optim
from ipf_jax import state as state_lib
from ipf_jax import step as step_lib
from ipf_jax import summary
from ipf_jax.data import create_dataset
from ipf_jax.data import layout
from ipf_jax.models import create_model

log = logging.getLogger("ipf_jax")


class NonFiniteError(FloatingPointError):
  """Every particle's loss or gradient became non-finite."""


class WorkdirError(OSError):
  """The workdir cannot be created or written."""


def setup_devices(config: ml_collections.ConfigDict) -> None:
  """Splits a CPU-only host into ``config.num_cpu_devices`` devices (before JAX starts its backend)."""
  if config.num_cpu_devices:
    try:
      jax.config.update("jax_num_cpu_devices", config.num_cpu_devices)
    except RuntimeError as e:  # backend already running (e.g. inside a test); keep what it has
      log.warning("num_cpu_devices=%d not applied: %s", config.num_cpu_devices, e)


def setup_logging(workdir: str) -> None:
  """Progress to stdout and ``workdir/train.log`` (process 0 only)."""
  log.setLevel(logging.INFO)
  log.propagate = False
  for h in list(log.handlers):
    log.removeHandler(h)
  if jax.process_index() != 0:
    log.addHandler(logging.NullHandler())
    return
  fmt = logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S")
  handlers = [logging.StreamHandler(sys.stdout)]
  if workdir:
    handlers.append(logging.FileHandler(os.path.join(workdir, "train.log")))
  for h in handlers:
    h.setFormatter(fmt)
    log.addHandler(h)


def _fmt_time(seconds: float) -> str:
  if not np.isfinite(seconds):
    return "--"
  seconds = int(max(seconds, 0))
  return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def one_program_at_a_time(x):
  """On the CPU, waits for ``x``: XLA:CPU runs the collectives of several devices on one shared
  thread pool, and with more than one collective program in flight (async dispatch) waiting
  participants can hold every thread, so a rendezvous never completes (seen here as
  "Termination timeout for all reduce ... Expected 8 threads"). GPUs and TPUs keep async dispatch."""
  if jax.default_backend() == "cpu" and jax.device_count() > 1:
    jax.block_until_ready(x)
  return x


def evaluate(eval_step, state, dataset, batch_size: int, mesh, fused_bn=None) -> dict:
  """Every test example exactly once (padded last batch, masked)."""
  total = None
  for batch in dataset.eval_batches(batch_size):
    sums = one_program_at_a_time(eval_step(state, layout.put_eval_batch(batch, mesh), fused_bn))
    weights = sums.pop("weights")
    total = sums if total is None else jax.tree.map(lambda a, b: a + b, total, sums)
  results = {k: metrics_lib.finalize(v) for k, v in jax.device_get(total).items()}
  results["weights"] = np.asarray(jax.device_get(weights))
  return results


def prepare_workdir(workdir: str) -> None:
  """Creates ``workdir``; its parent must exist and it must be writable."""
  parent = os.path.dirname(os.path.abspath(workdir))
  if not os.path.isdir(parent):
    raise WorkdirError(f"--workdir {workdir}: the parent directory {parent} does not exist; create it first "
                       "or choose another --workdir")
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:
    raise WorkdirError(f"--workdir {workdir}: cannot be created ({e.strerror}); choose a writable location") from None
  if not os.access(workdir, os.W_OK | os.X_OK) or not os.path.isdir(workdir):
    raise WorkdirError(f"--workdir {workdir}: is not a writable directory; fix its permissions or choose "
                       "another --workdir")


def format_eval_table(results: dict, shared_init: bool = True) -> str:
  """One row per particle (with its weight), the two ensembles and the fused model."""
  weights = results["weights"]
  rows = [("model", "weight", "accuracy", "NLL", "ECE")]
  p = results["particles"]
  for i in range(len(weights)):
    rows.append((f"particle {i}", f"{weights[i]:.3f}", f"{100 * p['accuracy'][i]:.2f}%", f"{p['nll'][i]:.4f}",
                 f"{p['ece'][i]:.4f}"))
  for name, key in (("ensemble (weighted)", "ensemble"), ("ensemble (uniform)", "ensemble_uniform"),
                    ("fused model", "fused"), ("fused model, BN re-estimated", "fused_bn")):
    if key not in results:
      continue
    r = results[key]
    rows.append((name, "", f"{100 * r['accuracy']:.2f}%", f"{r['nll']:.4f}", f"{r['ece']:.4f}"))
  widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
  lines = ["  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))) for r in rows]
  lines.insert(1, "-" * len(lines[0]))
  if not shared_init:
    lines.append("(independent inits: the fused model averages unrelated networks and is not meaningful)")
  return "\n".join(lines)


def _check_finite(state, num_particles: int, step: int) -> int:
  """Number of skipped (non-finite) steps; with several particles, any is fatal."""
  skipped = int(state.num_skipped)
  if skipped and num_particles > 1:
    raise NonFiniteError(f"step {step}: every particle's loss or gradient is non-finite. The update was skipped "
                         "and no checkpoint was written after it; the last good checkpoint is kept. Lower "
                         "config.base_lr or set config.grad_clip_norm, then run again to resume.")
  return skipped


class _Run:
  """Everything a run needs, built once from the config (shared by training and ``--eval_only``)."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str, for_training: bool = True):
    setup_devices(config)
    dp, dd = configuration.validate(config, jax.device_count())
    prepare_workdir(workdir)
    setup_logging(workdir)
    if jax.process_index() == 0 and for_training:
      with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json(indent=2))
    devices = jax.devices()[:config.num_devices or jax.device_count()]
    self.config, self.workdir = config, workdir
    self.mesh = mesh_lib.make_mesh(config.num_particles, devices, dp)
    self.spec = spec = configuration.particle_spec(config)
    log.info("mode=%s  particles=%d  mesh (particle, data)=(%d, %d) on %d %s device(s), %d process(es)  "
             "batch %d = %d particles x %d", config.mode, spec.num_particles, dp, dd, len(devices),
             devices[0].platform, jax.process_count(), config.global_batch_size, spec.num_particles,
             config.global_batch_size // spec.num_particles)
    self.dataset = create_dataset(config)
    self.model = create_model(config, self.dataset.num_classes, bn_axis_name=mesh_lib.DATA)
    self.steps_per_epoch = self.dataset.steps_per_epoch(config.global_batch_size)
    self.total, warmup = optim.train_steps(config, self.steps_per_epoch)
    self.lr_fn = optim.create_learning_rate_fn(config, self.total, warmup)
    self.tx = optim.create_optimizer(config, self.lr_fn)
    self.abstract_state, self.init_state = state_lib.train_state_init_from_config(
        config, spec, self.model, self.tx, self.dataset.image_shape, self.mesh)
    self.eval_step = step_lib.make_eval_step(self.model, self.mesh, config.particle_loop)
    self.fuse = step_lib.make_fuse_fn(self.mesh)
    self.fused_bn_fn = step_lib.make_fused_bn_fn(self.model, self.mesh, config.particle_loop)

  def restore(self, ckpt):
    """The newest readable checkpoint's state, or ``None``."""
    restored = ckpt.restore_latest(self.abstract_state, self.config)
    if restored is None:
      return None
    state, meta = restored
    log.info("resumed from %s at step %d (written on %d device(s))", ckpt.directory / str(meta["step"]),
             int(state.step), meta["num_devices"])
    return state

  def fused_bn(self, state):
    """The fused model's BatchNorm statistics averaged over ``fused_bn_batches`` training batches
    (the first ones of the run's data order), or ``None`` when that is 0."""
    n = self.config.fused_bn_batches
    if not n:
      return None
    g = self.config.global_batch_size
    batches = self.dataset.train_batches(0, g, self.config.seed)
    total = None
    for _ in range(n):
      batch = layout.put_train_batch(next(batches), self.spec.num_particles, self.mesh, self.dataset.process_local)
      stats = one_program_at_a_time(self.fused_bn_fn(state, batch))
      total = stats if total is None else jax.tree.map(jax.numpy.add, total, stats)
    return jax.tree.map(lambda x: x / n, total)

  def evaluate(self, state, fused_bn=None) -> dict:
    return evaluate(self.eval_step, state, self.dataset, self.config.eval_batch_size, self.mesh, fused_bn)

  def finish(self, state, writer=None) -> dict:
    """Final evaluation table, ``eval_results.json`` and the exported fused model (with re-estimated
    BatchNorm statistics when ``fused_bn_batches`` > 0)."""
    fused_bn = self.fused_bn(state)
    results = self.evaluate(state, fused_bn)
    step = int(state.step)
    log.info("final evaluation at step %d on %d %s test examples:\n%s", step, self.dataset.test_size,
             self.config.dataset, format_eval_table(results, self.spec.shared_init))
    variables, _ = self.fuse(state)
    if fused_bn is not None:
      variables = {**variables, "batch_stats": fused_bn}
    if writer is not None:
      writer.eval_results(step, results)
    if jax.process_index() == 0:
      with open(os.path.join(self.workdir, "eval_results.json"), "w") as f:
        json.dump({"step": step, **jax.tree.map(lambda x: np.asarray(x).tolist(), results)}, f, indent=1)
      export.export_fused(variables, self.config, self.dataset.num_classes,
                          os.path.join(self.workdir, "fused_model"))
    return results


def evaluate_checkpoint(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Evaluates the newest checkpoint in ``workdir`` and prints the table (``train.py --eval_only``)."""
  run = _Run(config, workdir, for_training=False)
  ckpt = checkpoint_lib.Checkpointer(workdir, keep=config.keep_checkpoints, async_save=False)
  state = run.restore(ckpt)
  ckpt.close()
  if state is None:
    raise checkpoint_lib.CheckpointError(f"--eval_only: no checkpoint in {ckpt.directory}; train first with the "
                                         f"same --workdir")
  return run.finish(state)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, step_hook=None) -> dict:
  """Trains ``config.num_particles`` particles and evaluates them; returns the final eval results.

  Resumes from the newest readable checkpoint in ``workdir/checkpoints`` if
  there is one. ``step_hook(step, state, batch) -> (state, batch)``, if
  given, runs before every step (fault-injection tests).
  """
  # ---- setup: mesh, data, model, state ------------------------------------------------------
  run = _Run(config, workdir)
  spec, mesh, total = run.spec, run.mesh, run.total
  ckpt = None
  state = None
  if config.checkpoint_every_steps >= 0:
    ckpt = checkpoint_lib.Checkpointer(workdir, keep=config.keep_checkpoints, async_save=config.async_checkpointing)
    state = run.restore(ckpt)
  if state is None:
    state = run.init_state()
  train_step = step_lib.make_train_step(run.model, run.tx, spec, mesh, label_smoothing=config.label_smoothing,
                                        particle_loop=config.particle_loop)
  writer = summary.SummaryWriter(workdir)

  # ---- loop ---------------------------------------------------------------------------------
  start = int(state.step)
  t_start = t_last = time.perf_counter()
  last_step = start
  pending = []  # per-step metrics still on the device, fetched at the next log step
  batches = layout.prefetch(run.dataset.train_batches(start, config.global_batch_size, config.seed),
                            lambda b: layout.put_train_batch(b, spec.num_particles, mesh, run.dataset.process_local))
  for step in range(start, total):
    batch = next(batches)
    if step_hook is not None:
      state, batch = step_hook(step, state, batch)
    state, m = one_program_at_a_time(train_step(state, batch))
    pending.append(m)
    done = step + 1
    if done % config.log_every_steps == 0 or done == total:
      fetched = jax.device_get(pending)
      pending = []
      skipped = _check_finite(state, spec.num_particles, done)
      now = time.perf_counter()
      rate = (done - last_step) / (now - t_last)
      for k, mk in enumerate(fetched, start=done - len(fetched) + 1):
        writer.train_step(k, mk, float(run.lr_fn(k // config.grad_accum_steps)))
      m = fetched[-1]
      _, distances = run.fuse(state)
      distances = np.asarray(distances)
      writer.scalars(done, {"train/images_per_s": rate * config.global_batch_size,
                            "train/resamples": int(state.num_resamples),
                            "train/diversity": float(np.nanmean(distances)),
                            **{f"particle/diversity/{i}": d for i, d in enumerate(distances)}})
      w = np.exp(m["log_weights"])
      loss = metrics_lib.weighted_train_loss(m)
      eta = (total - done) / rate if done > start + 1 else float("nan")
      scaling = ""
      if state.dynamic_scale is not None:
        scaling = f"  loss scale {float(state.dynamic_scale.scale):g} (overflows {int(state.num_overflows)})"
      log.info("step %d/%d  epoch %.1f  loss %.4f  ess %.2f/%d  max_w %.3f  resamples %d  alive %d/%d%s%s  "
               "diversity %.3g  lr %.4g  %.1f steps/s  ETA %s", done, total, done / run.steps_per_epoch, loss,
               float(m["ess"]), spec.num_particles, float(w.max()), int(state.num_resamples), int(m["num_alive"]),
               spec.num_particles, f"  skipped {skipped}" if skipped else "", scaling, float(np.nanmean(distances)),
               float(run.lr_fn(done // config.grad_accum_steps)), rate, _fmt_time(eta))
      t_last, last_step = now, done
    if ckpt and (done == total or (config.checkpoint_every_steps and done % config.checkpoint_every_steps == 0)):
      _check_finite(state, spec.num_particles, done)
      ckpt.save(done, state, config)
    if config.eval_every_steps and done % config.eval_every_steps == 0 and done != total:
      results = run.evaluate(state, run.fused_bn(state))
      writer.eval_results(done, results)
      log.info("eval step %d  ensemble acc %.2f%%  fused acc %.2f%%", done, 100 * results["ensemble"]["accuracy"],
               100 * results["fused"]["accuracy"])
  batches.close()
  if total > start:
    elapsed = time.perf_counter() - t_start
    log.info("trained %d steps in %s (%.1f steps/s)", total - start, _fmt_time(elapsed),
             (total - start) / max(elapsed, 1e-9))
  if ckpt:
    ckpt.close()

  # ---- final evaluation and export ----------------------------------------------------------
  results = run.finish(state, writer)
  writer.close()
  return results

"""``train_and_evaluate(config, workdir)``: a run's assembly, resume, the training loop and progress (its
evaluations: ``run_eval.Evaluations``)."""

from __future__ import annotations

import json
import logging
import os
from typing import Optional

import jax
import ml_collections
import optax

from ipf_jax import files, models
from ipf_jax.config import builder as build_lib
from ipf_jax.config import read, validation
from ipf_jax.config import sync as sync_lib
from ipf_jax.reporting import summary
from ipf_jax.reporting import trackers as trackers_lib
from ipf_jax.runtime import checkpoint as checkpoint_lib
from ipf_jax.runtime import compatibility, loop, preemption, rewind, run_eval
from ipf_jax.runtime.logs import keep_log, setup_logging
from ipf_jax.runtime import workdir as workdir_lib
from ipf_jax.runtime.preemption import RunStopped
from ipf_jax.spmd import fsdp, optim
from ipf_jax.spmd import step as step_lib
from ipf_jax.spmd import mesh as mesh_lib
from ipf_jax.spmd.task import Task

log = logging.getLogger("ipf_jax")
WorkdirError = workdir_lib.WorkdirError
NonFiniteError = loop.NonFiniteError
DivergedError = rewind.DivergedError


class _Run:
  """Everything a run needs, built once (shared by training and ``--eval_only``); its evaluations
  and the final table are ``evaluations`` (``run_eval.Evaluations``).

  Everything that can refuse the config runs before the workdir is touched. A training run then
  creates the workdir and holds its lock (process 0) until ``close()``; a reading run
  (``for_training=False``) needs an existing workdir and creates nothing.
  """

  def __init__(
    self,
    config: ml_collections.ConfigDict,
    workdir: str,
    for_training: bool = True,
    task: Optional[Task] = None,
    data=None,
    check_only: bool = False,
    optimizer: Optional[optim.Optimizer] = None,
    mesh: Optional[jax.sharding.Mesh] = None,
  ):
    if mesh is None:  # the devices set up and the config checked: once, before anything else
      mesh = build_lib.mesh_for(config)
    self.config, self.workdir, self.lock, self.for_training = config, workdir, None, for_training
    setup_logging(None)
    self.dataset, calibration = run_eval.hold_out(
      config, data if data is not None else read.dataset(config), data_given=data is not None
    )
    validation.validate_data(config, self.dataset.train_size, mesh.devices.size)
    self.zoo = task is None  # the task is the config's (its model follows config.model)
    if self.zoo:
      models.check_input(read.model_spec(config, self.dataset.num_classes), self.dataset.example)
    self.task = task or build_lib.zoo_task(config, self.dataset.num_classes)
    self.steps_per_epoch = self.dataset.steps_per_epoch(config.global_batch_size)  # None: unknown
    if self.steps_per_epoch is None and (config.num_epochs or config.warmup_epochs):
      raise validation.ConfigError(
        "num_epochs" if config.num_epochs else "warmup_epochs",
        f"the data {self.dataset.name!r} does not know its epoch length; give it one (ipf_jax.Data("
        "steps_per_epoch_fn=...)) or count in steps (num_train_steps, warmup_steps)",
      )
    self.optimizer = optimizer
    self.resumed_meta: dict = {}  # the meta of the checkpoint resumed from (restore): its rewind record
    self.parts = build_lib.build(
      config, self.task, self.dataset.example, self.steps_per_epoch or 1, optimizer=optimizer, mesh=mesh
    )
    self.optimizer_record = read.optimizer_record(config, optimizer, self.parts.abstract_state.opt_state)
    self.evaluations = run_eval.Evaluations(config, self.dataset, calibration, self.task, self.parts, workdir, self.zoo)
    self._open_workdir(check_only)
    self._log_plan()

  def _open_workdir(self, check_only: bool) -> None:
    """A training run creates the workdir and takes its lock (process 0); ``check_only`` (``--dry_run``) checks
    that it could; a reading run needs an existing one."""
    if check_only and self.for_training:
      workdir_lib.check(self.workdir)
    elif self.for_training:
      workdir_lib.prepare(self.workdir)
      if jax.process_index() == 0:
        self.lock = workdir_lib.Lock(self.workdir)
        self.lock.acquire()
      setup_logging(self.workdir)
    else:
      workdir_lib.require_existing(self.workdir, "--eval_only")

  def _log_plan(self) -> None:
    mesh, p, g = self.parts.mesh, self.parts.spec.num_particles, self.config.global_batch_size
    sync = sync_lib.resolve(self.config)  # the program "auto" chose, named
    log.info(
      "mode=%s%s  particles=%d  mesh (particle, data)=(%d, %d) on %d %s device(s), %d process(es)  "
      "batch %d = %d particles x %d",
      self.config.mode,
      f"  sync={sync}" + (" (auto)" if self.config.sync == "auto" else "") if p > 1 or sync != "step" else "",
      p,
      mesh.shape[mesh_lib.PARTICLE],
      mesh.shape[mesh_lib.DATA],
      mesh.devices.size,
      mesh.devices.flat[0].platform,
      jax.process_count(),
      g,
      p,
      g // p,
    )
    if self.config.fsdp:
      abstract = self.parts.abstract_state
      dims = fsdp.dims_of(jax.tree.map(lambda x: x.sharding.spec, abstract.params))
      how = step_lib.how_gathered(self.parts.spec, self.parts.task, dims)
      log.info("%s; %s", fsdp.summary(abstract), how)

  def state_signature(self, config: ml_collections.ConfigDict) -> compatibility.Signature:
    """The shapes and dtypes of the state that ``config`` builds (on this run's data and, for a task
    you brought, with your model): what a checkpoint must match. Compiles nothing."""
    task = build_lib.zoo_task(config, self.dataset.num_classes) if self.zoo else self.task
    return compatibility.signature(
      build_lib.state_shapes(config, task, self.dataset.example, self.steps_per_epoch or 1, self.optimizer)
    )

  def log_start(self):
    """Where a new population starts when ``config.init_from`` names a checkpoint (DESIGN.md §8)."""
    c = self.config
    if c.init_from:
      what = (
        f"particle {c.init_particle} of the newest checkpoint in {c.init_from}" if c.init_particle >= 0 else c.init_from
      )
      fresh = f"; fresh per particle: the parameters matching {c.init_reinit!r}" if c.init_reinit else ""
      log.info("every particle starts from %s%s", what, fresh)

  def restore(self, ckpt: checkpoint_lib.Checkpointer):
    """The newest usable checkpoint's state, or ``None`` when the workdir has none (says which)."""
    restored = ckpt.restore_latest(self.parts.abstract_state, self.config, shapes_for=self.state_signature)
    if restored is None:
      if self.for_training:  # --eval_only stops with its own error
        log.info("starting a new run: no checkpoint in %s", ckpt.directory)
        self.log_start()
      return None
    state, meta = restored
    self.resumed_meta = meta
    log.info(
      "%s %s at step %d (written on %d device(s))",
      "resumed from" if self.for_training else "evaluating",
      ckpt.directory / str(meta["step"]),
      int(state.step),
      meta["num_devices"],
    )
    saved, now = meta.get("optimizer"), self.optimizer_record  # the state fits; another optimizer is said
    if (saved.get("name") != now["name"]) if saved else not now["builtin"]:
      there = f"{saved.get('name')} ({saved.get('state')})" if saved else "the config's SGD (an older checkpoint)"
      log.warning(
        "this run's optimizer differs from the checkpoint's: %s there, %s (%s) here; %s with this run's",
        there,
        now["name"],
        now["state"],
        "training continues" if self.for_training else "it is evaluated",
      )
    note = compatibility.placement_note(self.config, meta, self.parts.mesh.shape[mesh_lib.PARTICLE])
    if note:
      log.warning("%s", note)
    changed = compatibility.changed_fields(meta["config"], self.config)
    if changed:  # allowed (a longer run, a lower learning rate), but never unsaid
      log.warning(
        "this run's config differs from the checkpoint's in %d field(s); %s with this run's values: %s",
        len(changed),
        "training continues" if self.for_training else "it is evaluated",
        "; ".join(changed),
      )
    return state

  def close(self) -> None:
    if self.lock is not None:
      self.lock.release()
      self.lock = None


def _no_checkpoint(ckpt) -> checkpoint_lib.CheckpointError:
  return checkpoint_lib.CheckpointError(
    f"--eval_only: no checkpoint in {ckpt.directory}; train first with the same --workdir"
  )


def check_run(
  config: ml_collections.ConfigDict,
  workdir: str,
  eval_only: bool = False,
  task: Optional[Task] = None,
  data=None,
  optimizer: Optional[optim.Optimizer] = None,
) -> str:
  """``train.py --dry_run``: every check a run makes before it trains (config, devices, data, workdir) and
  the plan, in words. Creates, compiles and writes nothing; raises the error the run would raise."""
  run = _Run(config, workdir, for_training=not eval_only, task=task, data=data, check_only=True, optimizer=optimizer)
  ckpt = checkpoint_lib.Checkpointer(
    workdir, read_only=True, data_name=run.dataset.name, optimizer=run.optimizer_record
  )
  if not eval_only:
    workdir_lib.Lock(workdir).probe()
    if config.checkpoint_every_steps < 0:
      _refuse_to_overwrite(workdir)
  reads = eval_only or config.checkpoint_every_steps >= 0  # checkpoint_every_steps=-1 never resumes
  latest = ckpt.check_latest(run.parts.abstract_state, config, shapes_for=run.state_signature) if reads else None
  step, saved_config = latest if latest is not None else (None, None)
  changed = compatibility.changed_fields(saved_config, config) if saved_config is not None else []
  total = run.parts.total_steps
  epoch = f" ({total / run.steps_per_epoch:.3g} epochs of {run.steps_per_epoch} steps)" if run.steps_per_epoch else ""
  if eval_only:
    if step is None:
      raise _no_checkpoint(ckpt)
    action = f"evaluate the checkpoint of step {step}"
  elif step is None:
    action = f"train {total} steps{epoch} from the start"
  elif step >= total:
    action = f"only evaluate: the checkpoint of step {step} is the end of the run"
  else:
    action = f"resume at step {step} of {total}{epoch}"
  accum = (
    f" as {config.grad_accum_steps} micro-batches of {config.global_batch_size // config.grad_accum_steps}"
    if config.grad_accum_steps > 1
    else ""
  )
  warmup = read.train_steps(config, run.steps_per_epoch or 1)[1]
  return (
    f"dry run: config, devices, data and --workdir {workdir} checked. Data {run.dataset.name!r}: "
    f"{run.dataset.train_size} train / {run.dataset.test_size} test examples; {config.global_batch_size} per "
    f"step{accum}; learning rate peaks at {float(run.parts.lr_fn(warmup)):.4g}. It would {action}"
    + (
      f", with this run's values of the {len(changed)} config field(s) that differ from the checkpoint's "
      f"({'; '.join(changed)})"
      if changed
      else ""
    )
    + ". Nothing was written."
  )


def evaluate_checkpoint(
  config: ml_collections.ConfigDict,
  workdir: str,
  task: Optional[Task] = None,
  data=None,
  optimizer: Optional[optim.Optimizer] = None,
) -> dict:
  """Evaluates the newest readable checkpoint in ``workdir`` and prints the table (``train.py --eval_only``).

  Reads only: creates no directory, moves no checkpoint; its results go to
  ``eval_results.step<N>.json`` and ``fused_model.step<N>.*`` beside the run's own.
  """
  run = _Run(config, workdir, for_training=False, task=task, data=data, optimizer=optimizer)
  ckpt = checkpoint_lib.Checkpointer(
    workdir, keep=config.keep_checkpoints, read_only=True, data_name=run.dataset.name, optimizer=run.optimizer_record
  )
  state = run.restore(ckpt)
  if state is None:
    raise _no_checkpoint(ckpt)
  return run.evaluations.finish(state, suffix=f".step{int(state.step)}")


def train_and_evaluate(
  config: ml_collections.ConfigDict,
  workdir: str,
  task: Optional[Task] = None,
  data=None,
  step_hook=None,
  optimizer: Optional[optim.Optimizer] = None,
  tx: Optional[optax.GradientTransformation] = None,
) -> dict:
  """Trains ``config.num_particles`` particles and evaluates them; returns the final eval results.

  ``task`` (default: classification with the zoo model ``config.model``) and ``data`` (default:
  ``read.dataset(config)``; any object with ``train_batches``, ``eval_batches``,
  ``steps_per_epoch``, ``train_size``, ``test_size``, ``example``, ``name``, see ``ipf_jax.data``)
  are what a library user brings; so is one particle's optimizer: ``optimizer=`` a function of the run's
  schedule (``lr_fn -> optax.GradientTransformation``, e.g. ``lambda lr: optax.adamw(lr, weight_decay=0.05)``)
  or ``tx=`` any ``optax.GradientTransformation``; default ``config.optimizer``. Each checkpoint records the
  optimizer's name and state kind.

  Resumes from the newest usable checkpoint in ``workdir/checkpoints``. SIGTERM,
  SIGINT and ``time_limit_minutes`` stop it after the step in flight with a
  checkpoint saved (``RunStopped``, with the exit code ``train.py`` uses).
  ``step_hook(step, state, batch) -> (state, batch)``, if given, runs before
  every step (fault-injection tests).
  """
  mesh = build_lib.mesh_for(config)  # before StopControl (its process count): devices set up, the config checked
  with preemption.StopControl(config.time_limit_minutes, config.checkpoint_every_minutes) as control:
    run = _Run(config, workdir, task=task, data=data, optimizer=optim.given(optimizer, tx), mesh=mesh)
    try:
      return _train(run, control, step_hook)
    finally:
      run.close()


def _train(run: _Run, control: preemption.StopControl, step_hook) -> dict:
  # ---- state: resume, or start a new run ---------------------------------------------------------
  config = run.config
  ckpt = None
  state = None
  if config.checkpoint_every_steps >= 0:
    ckpt = checkpoint_lib.Checkpointer(
      run.workdir,
      keep=config.keep_checkpoints,
      async_save=config.async_checkpointing,
      data_name=run.dataset.name,
      optimizer=run.optimizer_record,
    )
  try:
    if ckpt is not None:
      state = run.restore(ckpt)
    else:
      _refuse_to_overwrite(run.workdir)
    return _train_from(run, control, ckpt, state, step_hook)
  finally:
    if ckpt is not None:
      ckpt.abandon()  # after an error: orbax's threads released


def _stop_if_signalled_in_setup(control: preemption.StopControl, start: int, newest) -> None:
  """A signal during setup: nothing trained, nothing new to save. With several processes JAX's preemption
  sync point decides at the first step instead, so that every process stops at the same one."""
  early = control.signal_stop() if jax.process_count() == 1 else None
  if early is not None:
    message = f"stopped by {early.reason} before training step {start + 1}; nothing new to save" + (
      f" (newest checkpoint: step {newest})" if newest is not None else ""
    )
    log.info(message)
    raise RunStopped(message, early.exit_code)


def _track_files(workdir: str, writer) -> None:
  """The run's files to the trackers that keep artifacts (none with TensorBoard alone): the fused model, the
  results and the report's pictures (drawn here for them)."""
  if not writer.sinks:
    return
  from ipf_jax.reporting import report

  try:
    pictures = report.write_report(workdir)
  except Exception as e:  # noqa: BLE001 - pictures for a tracker never fail a finished run
    log.info("no report pictures for the trackers (%s)", e)
    pictures = []
  names = ("eval_results.json", "config.json", "fused_model.msgpack", "fused_model.json")
  writer.artifacts([os.path.join(workdir, n) for n in names] + list(pictures))


def _refuse_to_overwrite(workdir: str) -> None:
  """``checkpoint_every_steps=-1`` cannot resume: it must not start over in a workdir that holds a run."""
  held = [name for name in ("checkpoints", "eval_results.json") if os.path.exists(os.path.join(workdir, name))]
  if held:
    raise checkpoint_lib.CheckpointError(
      f"--workdir {workdir} holds a run ({', '.join(held)}) and config.checkpoint_every_steps=-1 cannot resume "
      "it: training would start from step 0 and overwrite its results. Resume with checkpoint_every_steps >= 0, "
      "or use a new --workdir."
    )


def _train_from(run: _Run, control: preemption.StopControl, ckpt, state, step_hook) -> dict:
  record = sync_lib.recorded(run.config)  # config.json's and the trackers'
  if jax.process_index() == 0:  # only once the checkpoint is known to fit this config
    keep_log(run.workdir)
    files.write_atomic(os.path.join(run.workdir, "config.json"), json.dumps(record, indent=2))
  if state is None:
    state = run.parts.init_state()
  start = int(state.step)
  newest = start if ckpt is not None and ckpt.latest_step() == start else None
  _stop_if_signalled_in_setup(control, start, newest)
  writer = summary.SummaryWriter(run.workdir, trackers=trackers_lib.parse(run.config.trackers), config=record)
  finished = False
  interrupted = (lambda: control.signalled) if jax.process_count() == 1 else (lambda: False)
  try:
    watch = rewind.Watch.from_config(run.config, run.resumed_meta.get("rewind"))
    training = loop.Training(run, control, ckpt, writer, state, newest, interrupted, step_hook, watch)
    try:
      stop = training.run_steps()
    except checkpoint_lib.SaveError:
      # Full disk or lost directory: what was saved stays. One process still shows how the unsaved state
      # does; several skip it (the evaluation needs every process, and each may have stopped elsewhere).
      if jax.process_count() == 1:
        log.info(
          "a checkpoint could not be saved; evaluating the state in memory (step %d, not saved)",
          int(training.state.step),
        )
        try:
          run.evaluations.finish(training.state, writer, interrupted=interrupted)
        except InterruptedError:
          pass
      raise
    state, newest = training.state, training.newest
    saved = newest == int(state.step)
    if stop is not None:
      what = "checkpoint saved" if saved else "checkpoints are off (checkpoint_every_steps=-1): nothing saved"
      message = f"stopped at step {int(state.step)} by {stop.reason}; {what}; rerun the same command to resume"
      log.info(message)
      raise RunStopped(message, stop.exit_code)
    # ---- final evaluation and export (the last checkpoint is committed) -----------------------
    try:
      results = run.evaluations.finish(state, writer, interrupted=interrupted)
      finished = True
      _track_files(run.workdir, writer)
      return results
    except InterruptedError:
      stop = control.signal_stop()
      what = (
        "the checkpoint is saved; rerun the same command to evaluate it"
        if saved
        else "checkpoints are off: nothing was saved"
      )
      message = f"stopped by {stop.reason} during the final evaluation at step {int(state.step)}; {what}"
      log.info(message)
      raise RunStopped(message, stop.exit_code)
  finally:
    writer.close(finished)

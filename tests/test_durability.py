"""Nothing lost (DESIGN.md "Durability"), tried as a hostile user would, through train.py.

Signals at random points, a config changed between runs, every checkpoint
damaged, two runs on one workdir, readers on a killed run's files, a full disk.
Each interrupted run is resumed and must end with the uninterrupted run's
final table and state, bit for bit.
"""

import json
import os
import random
import resource
import shutil
import signal
import subprocess

import jax
import numpy as np
import pytest

from ipf_jax.reporting import report
from tests import helpers

pytestmark = pytest.mark.slow  # CI: leg 1 only (pytest.ini)

STEPS = 30
FLAGS = (
  f"--config.num_train_steps={STEPS}",
  "--config.checkpoint_every_steps=10",
  "--config.log_every_steps=1",
  "--config.eval_every_steps=10",
  "--config.fused_bn_batches=2",
)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("uninterrupted")
  r = helpers.run_train_py(workdir, *FLAGS)
  assert r.returncode == 0, r.stdout + r.stderr
  assert f"starting a new run: no checkpoint in {workdir / 'checkpoints'}" in r.stdout
  return workdir, helpers.final_table(r.stdout)


def state_at(workdir, step):
  return helpers.load_checkpoint_numpy(workdir / "checkpoints" / str(step) / "state")


def assert_same_run(workdir, out, uninterrupted):
  reference, table = uninterrupted
  assert helpers.final_table(out) == table
  jax.tree.map(np.testing.assert_array_equal, state_at(workdir, STEPS), state_at(reference, STEPS))


def listing(path):
  """Every file under ``path`` with its content hash (but the lock file, which names its holder): what
  "nothing was touched" compares."""
  import hashlib

  return sorted(
    (os.path.relpath(os.path.join(d, f), path), hashlib.sha1(open(os.path.join(d, f), "rb").read()).hexdigest())
    for d, _, files in os.walk(path)
    for f in files
    if f != ".lock"
  )


# ---- preemption: SIGTERM / SIGINT, then resume ----------------------------------------------------------------


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_saves_then_resume_equals_uninterrupted(uninterrupted, tmp_path, sig, code):
  """Through train.py: SIGTERM or Ctrl-C at a random step (the periodic evaluation, BatchNorm
  re-estimation and a background save run in between)."""
  k = random.Random(f"{sig}").randint(2, STEPS - 3)
  trigger = f"step {k}/{STEPS}"
  run = helpers.Running(helpers.train_py_argv(tmp_path, *FLAGS))
  assert run.wait_for(trigger) is not None
  run.signal(sig)
  rc, out = run.finish()
  assert rc == code, out[-3000:]
  name = signal.Signals(sig).name
  assert f"{name} received: finishing the step in flight, then saving a checkpoint and stopping" in out
  assert "Traceback" not in out
  line = next(x for x in out.splitlines() if "stopped " in x)
  stopped = int(line.split("stopped at step ")[1].split()[0])
  assert line.endswith(f"stopped at step {stopped} by {name}; checkpoint saved; rerun the same command to resume")
  assert str(stopped) in os.listdir(tmp_path / "checkpoints"), "the stop step itself is saved: nothing lost"
  r = helpers.run_train_py(tmp_path, *FLAGS)
  assert r.returncode == 0, r.stdout + r.stderr
  assert f"resumed from {tmp_path / 'checkpoints' / str(stopped)} at step {stopped}" in r.stdout
  assert_same_run(tmp_path, r.stdout, uninterrupted)


def small_config(**kw):
  from configs import digits

  config = digits.get_config()
  config.num_train_steps, config.log_every_steps, config.checkpoint_every_steps = 12, 1, 5
  config.eval_batch_size = 150
  config.cnn_features = helpers.TEST_FEATURES  # as helpers.run_train_py: the tests resume each other's runs
  for k, v in kw.items():
    config[k] = v
  return config


@pytest.fixture(scope="module")
def in_process_reference(tmp_path_factory):
  from ipf_jax.runtime import trainer

  workdir = tmp_path_factory.mktemp("in_process")
  return workdir, trainer.train_and_evaluate(small_config(), str(workdir))


def test_signal_during_compilation_evaluation_and_final_evaluation(in_process_reference, tmp_path, monkeypatch):
  """A signal before the first step has compiled: that step ends, is saved, the run stops. Ctrl-C during
  the periodic evaluation: it is cut short, the next step is saved, the run stops. A signal during the
  final evaluation (BN re-estimation): the last checkpoint is already committed; a rerun only
  evaluates. Each ends where the uninterrupted run ends."""
  from ipf_jax.runtime import preemption, trainer

  reference_dir, reference = in_process_reference

  def signal_first(step, state, batch):
    if step == 0:
      os.kill(os.getpid(), signal.SIGTERM)
    return state, batch

  with pytest.raises(preemption.RunStopped, match=r"stopped at step 1 by SIGTERM; checkpoint saved") as e:
    trainer.train_and_evaluate(small_config(), str(tmp_path), step_hook=signal_first)
  assert e.value.exit_code == 143 and os.listdir(tmp_path / "checkpoints") == ["1"]

  from ipf_jax.runtime import run_eval

  evaluate = run_eval.Evaluations.evaluate
  cut = []

  def signal_then_evaluate(self, state, fused_bn=None, interrupted=lambda: False):
    os.kill(os.getpid(), signal.SIGINT)
    try:
      return evaluate(self, state, fused_bn, interrupted)
    except InterruptedError:
      cut.append(int(state.step))
      raise

  with monkeypatch.context() as m:
    m.setattr(run_eval.Evaluations, "evaluate", signal_then_evaluate)
    with pytest.raises(preemption.RunStopped, match=r"stopped at step 5 by SIGINT; checkpoint saved") as e:
      trainer.train_and_evaluate(small_config(eval_every_steps=4), str(tmp_path))
  assert e.value.exit_code == 130 and cut == [4], "the evaluation at step 4 was cut short, step 5 saved"

  original = run_eval.Evaluations.fused_bn

  def signal_then_fused_bn(self, state, interrupted):
    os.kill(os.getpid(), signal.SIGTERM)
    return original(self, state, interrupted)

  with monkeypatch.context() as m:
    m.setattr(run_eval.Evaluations, "fused_bn", signal_then_fused_bn)
    with pytest.raises(preemption.RunStopped, match="during the final evaluation at step 12; the checkpoint is saved"):
      trainer.train_and_evaluate(small_config(fused_bn_batches=1), str(tmp_path))
  results = trainer.train_and_evaluate(small_config(), str(tmp_path))
  for row in ("ensemble", "fused"):
    np.testing.assert_array_equal(results[row]["nll"], reference[row]["nll"])
  jax.tree.map(np.testing.assert_array_equal, state_at(tmp_path, 12), state_at(reference_dir, 12))


def test_checkpoints_off_never_start_over_on_a_run(uninterrupted, tmp_path):
  """checkpoint_every_steps=-1 cannot resume: on a workdir that holds a run it stops, touching nothing."""
  workdir = tmp_path / "w"
  shutil.copytree(uninterrupted[0], workdir)
  before = listing(workdir)
  from ipf_jax.runtime import checkpoint, trainer

  with pytest.raises(checkpoint.CheckpointError, match="checkpoint_every_steps=-1 cannot resume it"):
    trainer.train_and_evaluate(small_config(checkpoint_every_steps=-1), str(workdir))
  assert listing(workdir) == before


def test_a_save_that_cannot_fit_is_refused_before_writing(tmp_path, monkeypatch):
  """The space check before a save: nothing is written, the error names the path and the free space."""
  import collections

  from ipf_jax.runtime import checkpoint, trainer

  config = small_config(num_train_steps=3, checkpoint_every_steps=2)
  usage = collections.namedtuple("usage", "total used free")
  monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: usage(10 << 20, 10 << 20, 1 << 20))
  with pytest.raises(
    checkpoint.SaveError,
    match=r"saving checkpoint 2 to .* failed: no space left on the device "
    r"\(about [\d.]+ MiB needed\); 1.0 MiB free of 10.0 MiB there. No complete checkpoint exists",
  ):
    trainer.train_and_evaluate(config, str(tmp_path))
  assert not os.path.exists(tmp_path / "checkpoints") or os.listdir(tmp_path / "checkpoints") == []
  assert (tmp_path / "eval_results.json").exists(), "the state in memory was still evaluated"


def test_time_limit_and_wall_clock_saves(tmp_path):
  from ipf_jax.runtime import preemption, trainer

  config = small_config(num_train_steps=40, checkpoint_every_steps=0)
  config.checkpoint_every_minutes = 1e-9  # every log step is due
  config.time_limit_minutes = 1e-9
  with pytest.raises(preemption.RunStopped, match="stopped at step 1 by time_limit_minutes") as e:
    trainer.train_and_evaluate(config, str(tmp_path))
  assert e.value.exit_code == 75 and os.listdir(tmp_path / "checkpoints") == ["1"]
  config.time_limit_minutes = 0.0
  config.num_train_steps = 4
  config.keep_checkpoints = 10
  trainer.train_and_evaluate(config, str(tmp_path))
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "2", "3", "4"], "a save at every due log step"


# ---- restore errors are not corruption ------------------------------------------------------------------------


def test_config_change_stops_naming_the_field_and_touches_nothing(uninterrupted, tmp_path):
  workdir = tmp_path / "w"
  shutil.copytree(uninterrupted[0], workdir)
  before = listing(workdir)
  r = helpers.run_train_py(workdir, *FLAGS, "--config.cnn_features=(16,64,128)")
  assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
  assert (
    "does not fit this run's state: params/BatchNorm_0/bias is (8, 8) float32 there and (8, 16) float32 here"
  ) in r.stderr
  assert (
    "It was written with config.cnn_features=[8, 16, 32]; this run has config.cnn_features=[16, 64, 128]" in r.stderr
    and "--config.cnn_features=(8,16,32)" in r.stderr
  )
  assert listing(workdir) == before, "nothing is renamed, replaced or overwritten (config.json included)"


def test_the_fields_that_decide_a_shape_are_derived_from_the_state(tmp_path):
  """small_inputs changes a ResNet stem's kernel but was on no list: the derivation finds it."""
  from configs import digits
  from ipf_jax.runtime import checkpoint, compatibility, trainer

  config = digits.get_config()
  config.model = "resnet_tiny"
  run = trainer._Run(config, str(tmp_path))
  try:
    changed = digits.get_config()
    changed.model, changed.small_inputs, changed.seed, changed.base_lr = "resnet_tiny", True, 3, 0.5
    assert compatibility.decisive_fields(json.loads(changed.to_json()), config, run.state_signature) == ["small_inputs"]
    with pytest.raises(
      checkpoint.CheckpointError,
      match=r"params/conv_init/kernel is \(8, 3, 3, 1, 8\) float32 "
      r"there and \(8, 7, 7, 1, 8\) float32 here.*It was written with config.small_inputs=True",
    ):
      compatibility.check_compatible(
        run.state_signature(changed),
        json.loads(changed.to_json()),
        run.state_signature(config),
        config,
        "ckpt",
        run.state_signature,
      )
  finally:
    run.close()


def test_every_checkpoint_unreadable_stops_and_touches_nothing(uninterrupted, tmp_path):
  workdir = tmp_path / "w"
  shutil.copytree(uninterrupted[0], workdir)
  for step in os.listdir(workdir / "checkpoints"):  # truncate the largest file of each checkpoint
    files = [os.path.join(d, f) for d, _, fs in os.walk(workdir / "checkpoints" / step) for f in fs]
    open(max(files, key=os.path.getsize), "w").close()
  before = listing(workdir)
  r = helpers.run_train_py(workdir, *FLAGS)
  assert r.returncode == 1, r.stdout + r.stderr
  assert f"error: no checkpoint in {workdir / 'checkpoints'} can be read (30: " in r.stderr
  assert "; 20: " in r.stderr and "; 10: " in r.stderr and "training did not start over" in r.stderr
  assert "starting a new run" not in r.stdout and "step 1/" not in r.stdout
  assert listing(workdir) == before and len(r.stderr.splitlines()) == 1


# ---- one run per workdir --------------------------------------------------------------------------------------


def test_second_run_on_a_workdir_is_refused_naming_the_holder(tmp_path):
  first = helpers.Running(helpers.train_py_argv(tmp_path, "--config.num_train_steps=400", "--config.log_every_steps=1"))
  try:
    assert first.wait_for("step 2/400") is not None
    config_before = (tmp_path / "config.json").read_text()
    r = helpers.run_train_py(tmp_path, "--config.num_train_steps=400", "--config.seed=7")
    assert r.returncode == 1 and len(r.stderr.splitlines()) == 1, r.stderr
    assert f"error: --workdir {tmp_path} is in use by another run (pid {first.proc.pid} on host " in r.stderr
    assert (tmp_path / "config.json").read_text() == config_before
  finally:
    first.signal(signal.SIGKILL)
    first.finish()
  from ipf_jax.runtime import workdir as workdir_lib

  lock = workdir_lib.Lock(str(tmp_path))  # the kernel released the killed run's lock: the next run may start
  lock.acquire()
  lock.release()


# ---- readers tolerate what writers leave; they create nothing ----------------------------------------------------


def test_report_reads_a_killed_runs_truncated_events(uninterrupted, tmp_path):
  workdir = tmp_path / "w"
  shutil.copytree(uninterrupted[0], workdir)
  (events,) = [f for f in os.listdir(workdir) if f.startswith("events.out.tfevents")]
  full = report.read_scalars(str(workdir))
  size = os.path.getsize(workdir / events)
  os.truncate(workdir / events, size - 9)  # the last record cut off, as SIGKILL leaves it
  cut = report.read_scalars(str(workdir))
  assert len(cut["train/loss"][0]) >= STEPS - 1 and np.array_equal(
    cut["train/loss"][1], full["train/loss"][1][: len(cut["train/loss"][0])]
  )
  r = subprocess.run(
    [os.sys.executable, "-m", "ipf_jax.reporting", str(workdir)], cwd=helpers.ROOT, capture_output=True, text=True
  )
  assert r.returncode == 0 and len(os.listdir(workdir / "report")) == 5, r.stderr  # + calibration.png


def test_readers_create_nothing_and_replace_nothing(uninterrupted, tmp_path):
  missing = tmp_path / "typo"
  r = helpers.run_train_py(missing, "--eval_only")
  assert r.returncode == 1 and "does not exist" in r.stderr and not missing.exists()
  r = subprocess.run(
    [os.sys.executable, "-m", "ipf_jax.reporting", str(missing)], cwd=helpers.ROOT, capture_output=True, text=True
  )
  assert r.returncode != 0 and "does not exist" in r.stderr and not missing.exists()

  workdir = tmp_path / "w"
  shutil.copytree(uninterrupted[0], workdir)
  newest = workdir / "checkpoints" / str(STEPS)
  for d, _, files in os.walk(newest / "state"):  # the newest checkpoint is damaged
    for f in files:
      if os.path.getsize(os.path.join(d, f)) > 100_000:
        open(os.path.join(d, f), "w").close()
  before = listing(workdir)
  r = helpers.run_train_py(workdir, *FLAGS, "--eval_only")
  assert r.returncode == 0, r.stdout + r.stderr
  assert f"evaluating {workdir / 'checkpoints' / '20'} at step 20" in r.stdout
  after = dict(listing(workdir))
  for path, digest in before:  # the run's own results and the damaged checkpoint: untouched
    assert after.pop(path) == digest, path
  assert sorted(after) == ["eval_results.step20.json", "fused_model.step20.json", "fused_model.step20.msgpack"]
  assert json.load(open(workdir / "eval_results.step20.json"))["step"] == 20


# ---- a full disk ----------------------------------------------------------------------------------------------


def _tmpfs(path, megabytes):
  """A small tmpfs at ``path``, or None where this machine does not allow mounting one."""
  path.mkdir()
  r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(path)], capture_output=True)
  return path if r.returncode == 0 else None


@pytest.mark.parametrize("limit", ["tmpfs", "file_size"])
def test_full_disk_stops_cleanly_keeping_the_last_checkpoint(tmp_path, limit):
  """tmpfs: the disk fills before a save (caught before anything is written). file_size: writes fail in the
  middle of a background save (RLIMIT_FSIZE), the failure path a disk filled by someone else takes."""
  flags = (
    "--config.num_train_steps=30",
    "--config.checkpoint_every_steps=10",
    "--config.log_every_steps=10",
    "--config.keep_checkpoints=1",
  )
  if limit == "tmpfs":
    mount = _tmpfs(tmp_path / "mnt", 9)
    if mount is None:
      pytest.skip("mounting a tmpfs is not permitted here; the file_size case covers the failed save")
    workdir, preexec = mount / "run", None
  else:
    workdir = tmp_path / "run"

    def preexec():  # files beyond 2 MB cannot be written; a checkpoint's data files are larger
      signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
      resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, 2 << 20))

  try:
    r = helpers.run_train_py(workdir, *flags, preexec_fn=preexec, full_model=True)  # checkpoints of the sizes above
  finally:
    if limit == "tmpfs":
      saved = sorted(os.listdir(workdir / "checkpoints"))
      subprocess.run(["umount", str(tmp_path / "mnt")], check=False)
  if limit != "tmpfs":
    saved = sorted(os.listdir(workdir / "checkpoints"))
  assert r.returncode == 1, r.stdout + r.stderr
  (error,) = [line for line in r.stderr.splitlines() if line.strip()]
  assert error.startswith("error: saving checkpoint ") and " free of " in error and "failed: " in error
  assert "Traceback" not in r.stdout + r.stderr and "Event loop is closed" not in r.stderr
  if limit == "tmpfs":
    assert "no space left on the device" in error and "The newest complete checkpoint is step 10 (kept)" in error
    assert "10" in saved, "keep_checkpoints=1 never deletes the last good checkpoint before a new one is committed"
  else:  # the first save's data files are over the limit: it fails in the background, nothing passes as complete
    assert "File too large" in error and "No complete checkpoint exists" in error, error
    assert not [d for d in saved if d.isdigit()], saved
  assert "final evaluation at step" in r.stdout and "fused model" in r.stdout, "the table it can still print"


# ---- bad input: one line each ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "flags,message",
  [
    (["--config.temperature=inf"], "error: config.temperature: must be a finite number, got inf"),
    (["--config.seed=-1"], "error: config.seed: must be an integer in [0, 2**32), got -1"),
    (
      ["--config.foo=1"],
      "error: --config.foo=1: the config has no field 'foo'; ipf_jax/config/defaults.py lists every",
    ),
    (
      ["--config.temprature=3"],
      "error: --config.temprature=3: the config has no field 'temprature'; did you mean --config.temperature?",
    ),
    (
      ["--config.train_fraction=0.001", "--config.global_batch_size=2048"],
      "error: config.train_fraction: 0.001 keeps 1 training example, fewer than one global batch",
    ),
  ],
)
def test_bad_input_is_one_line_and_creates_nothing(tmp_path, flags, message):
  r = helpers.run_train_py(tmp_path / "w", *flags)
  assert r.returncode in (1, 2) and r.stderr.strip().startswith(message), r.stderr
  assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "w").exists()


def test_divergence_without_checkpoint_says_so(tmp_path):
  from ipf_jax.runtime import trainer

  config = small_config(num_train_steps=6, checkpoint_every_steps=0)

  def hook(step, state, batch):
    return state, (dict(batch, image=batch["image"] * np.nan) if step == 2 else batch)

  with pytest.raises(trainer.NonFiniteError, match="no checkpoint had been written yet") as e:
    trainer.train_and_evaluate(config, str(tmp_path), step_hook=hook)
  assert "kept" not in str(e.value)

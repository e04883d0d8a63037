"""train.py end to end on real digits, as a user runs it."""

import json
import os

import pytest

from tests.helpers import run_train_py as run_train

pytestmark = pytest.mark.slow  # CI: leg 1 only (pytest.ini)


def test_train_py_digits_smoke(tmp_path):
  r = run_train(
    tmp_path,
    "--config.num_train_steps=20",
    "--config.log_every_steps=10",
    "--config.eval_shifts=contrast",
    "--config.shift_examples=100",
    "--config.ood_dataset=photos",
    "--config.calibration_fraction=0.1",
    full_model=True,
  )
  assert r.returncode == 0, r.stdout + r.stderr
  out = r.stdout
  assert "mesh (particle, data)=(8, 1) on 8 cpu device(s)" in out
  assert "step 10/20" in out and "step 20/20" in out and "ETA" in out and "steps/s" in out
  for row in ["particle 7", "ensemble (weighted)", "ensemble (uniform)", "fused model"]:
    assert row in out
  results = json.load(open(tmp_path / "eval_results.json"))
  assert len(results["particles"]["accuracy"]) == 8
  assert results["ensemble"]["accuracy"] > 0.5, "20 steps on digits should already beat chance by far"
  assert json.load(open(tmp_path / "config.json"))["num_particles"] == 8
  assert "final evaluation" in open(tmp_path / "train.log").read()
  # the evaluation suite: held-out temperature, each severity of the shift, OOD AUROC, diversity
  assert results["calibration_examples"] == 135  # 10% of the 1347 training images, trained on the other 1212
  for row in ("ensemble", "fused"):
    t = results["temperature_scaled"][row]
    assert 0.25 <= t["temperature"] <= 8 and t["nll"] > 0
    assert 0.0 < results["ood"][row]["auroc_max_prob"] <= 1.0 and 0.0 < results["ood"][row]["auroc_entropy"] <= 1.0
  assert sorted(results["shifts"]) == [f"contrast_{s}" for s in range(1, 6)]
  assert results["shifts"]["contrast_5"]["ensemble"]["accuracy"] < results["ensemble"]["accuracy"]
  scaled = results["shifts"]["contrast_5"]["temperature_scaled"]["ensemble"]  # at the calibration set's temperature
  assert scaled["temperature"] == results["temperature_scaled"]["ensemble"]["temperature"] and scaled["ece"] >= 0
  assert len(results["ood"]["particles"]["auroc_max_prob"]) == 8
  for line in (
    "diversity of the population: disagreement",
    "temperature scaling, fused model: T =",
    "contrast  ",
    "ensemble ECE at T",
    "OOD AUROC (photos), ensemble (weighted): max prob",
  ):
    assert line in out, line
  from ipf_jax.reporting import report

  pictures = [os.path.basename(p) for p in report.write_report(str(tmp_path), str(tmp_path / "report"))]
  assert pictures[-2:] == ["calibration.png", "shifts.png"]


def test_train_py_ddp_mode_trains_one_model(tmp_path):
  """README's Modes table: ``--config.mode=ddp`` alone (the config has 8 particles) trains one model."""
  r = run_train(tmp_path, "--config.mode=ddp", "--config.num_train_steps=10", "--config.log_every_steps=5")
  assert r.returncode == 0, r.stdout + r.stderr
  assert "mode=ddp trains one model: num_particles=1 (the config's 8" in r.stdout
  assert "particles=1  mesh (particle, data)=(1, 8)" in r.stdout
  assert "particle 0" in r.stdout and "particle 1 " not in r.stdout


def test_train_py_float16_with_loss_scaling(tmp_path):
  """float16 from a scale that overflows at first: the run backs off, skips those steps without
  calling them failures, and still learns; the scale is in the progress line and TensorBoard."""
  r = run_train(
    tmp_path,
    "--config.dtype=float16",
    "--config.loss_scale_init=1073741824.0",
    "--config.num_train_steps=60",
    "--config.log_every_steps=30",
  )  # the test CNN: 81% measured
  assert r.returncode == 0, r.stdout + r.stderr
  line = next(x for x in r.stdout.splitlines() if "step 60/60" in x)
  overflows = int(line.split("overflows ")[1].split(")")[0])
  scale = float(line.split("loss scale ")[1].split()[0])
  assert 1 <= overflows < 40 and scale < 2.0**40 and "skipped" not in line
  results = json.load(open(tmp_path / "eval_results.json"))
  assert results["ensemble"]["accuracy"] > 0.7, results["ensemble"]
  from ipf_jax.reporting import report

  scalars = report.read_scalars(str(tmp_path))
  steps, overflow = scalars["train/overflow"]
  assert len(steps) == 60 and overflow.sum() == overflows and len(scalars["train/loss_scale"][0]) == 60
  pictures = [os.path.basename(p) for p in report.write_report(str(tmp_path), str(tmp_path / "report"))]
  assert pictures == ["training_curves.png", "weights.png", "genealogy.png", "eval.png", "calibration.png"]


def test_train_py_bad_config_is_one_clear_error(tmp_path):
  r = run_train(tmp_path, "--config.num_particles=3")
  assert r.returncode != 0
  assert "error: config.global_batch_size: 128 is not divisible by num_particles x data devices" in r.stderr
  assert "Traceback" not in r.stderr


def test_default_workdir_parent_ships_with_the_repo():
  """`python train.py` (default --workdir runs/digits) works in a fresh clone: runs/ is tracked."""
  import os
  import subprocess

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  tracked = subprocess.run(["git", "ls-files", "runs"], cwd=root, capture_output=True, text=True).stdout.split()
  assert "runs/.gitkeep" in tracked


def test_dry_run_checks_as_a_run_does_and_writes_nothing(tmp_path, monkeypatch):
  """``--dry_run`` (in process): the plan for a new workdir, which it does not create; ``--eval_only`` without a
  checkpoint and a workdir another run holds are the errors the real commands give."""
  import pytest

  from configs import digits
  from ipf_jax.runtime import checkpoint, trainer
  from ipf_jax.runtime import workdir as workdir_lib
  from tests import helpers

  config = digits.get_config()
  config.cnn_features = helpers.TEST_FEATURES
  from ipf_jax.config import validation

  calls = []  # a run is assembled once: its devices set up once, its config checked once
  for name in ("setup_devices", "validate"):
    real = getattr(validation, name)
    monkeypatch.setattr(validation, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
  plan = trainer.check_run(config, str(tmp_path / "new"))
  assert calls == ["setup_devices", "validate"]
  assert "would train 300 steps (30 epochs of 10 steps) from the start" in plan and "1347 train / 450 test" in plan
  assert not (tmp_path / "new").exists()
  with pytest.raises(checkpoint.CheckpointError, match="--eval_only: no checkpoint"):
    trainer.check_run(config, str(tmp_path), eval_only=True)
  lock = workdir_lib.Lock(str(tmp_path))
  lock.acquire()  # flock: a second open file in this process conflicts as another process's would
  try:
    with pytest.raises(workdir_lib.WorkdirError, match="in use by another run"):
      trainer.check_run(config, str(tmp_path))
  finally:
    lock.release()
  assert os.listdir(tmp_path) == [".lock"]
  # An object-store URL is refused by name, for training and for reading, before anything is created
  # (os.path would have read gs://b/run as the local folders gs:/b/run).
  monkeypatch.chdir(tmp_path)
  for url, eval_only in (("gs://bucket/run", False), ("ram://run", True)):
    with pytest.raises(workdir_lib.WorkdirError, match=url.split(":")[0] + ":// paths are not supported.*gcsfuse"):
      trainer.check_run(config, url, eval_only=eval_only)
    with pytest.raises(workdir_lib.WorkdirError, match="paths are not supported"):
      trainer.train_and_evaluate(config, url)
  assert sorted(os.listdir(tmp_path)) == [".lock"]


def test_first_contact_help_a_missing_config_and_a_file_as_workdir(tmp_path):
  """``--help`` lists the command's flags and exits 0; a config path that does not exist and a ``--workdir``
  that is a file are one line each, naming what is wrong."""
  import subprocess
  import sys

  from tests import helpers

  def train(*args):
    cmd = [sys.executable, "train.py", *args]
    return subprocess.run(
      cmd, cwd=helpers.ROOT, capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu")
    )

  r = train("--help")
  assert r.returncode == 0, r.stderr
  assert "--workdir" in r.stdout and "--[no]dry_run" in r.stdout and "--config.FIELD=VALUE" in r.stdout
  r = train("--config", "configs/digit.py")
  assert r.returncode == 2
  assert r.stderr.strip().splitlines()[-1].startswith("error: --config configs/digit.py: no such file; the configs")
  assert "digits.py" in r.stderr and "__init__" not in r.stderr
  afile = tmp_path / "afile"
  afile.write_text("")
  r = train("--workdir", str(afile), "--config.num_train_steps=1")
  assert r.returncode == 1
  assert f"error: --workdir {afile}: is a file, not a directory" in r.stderr and "Traceback" not in r.stderr

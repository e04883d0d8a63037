"""examples/ run as tests; the package installs into a fresh virtualenv and runs outside the checkout."""

import os
import subprocess
import sys

import numpy as np
import pytest

from tests import helpers

pytestmark = pytest.mark.slow  # CI: leg 1 only (pytest.ini)

sys.path.insert(0, os.path.join(helpers.ROOT, "examples"))


def test_regression_example_reports_nll_and_rmse(tmp_path):
  import regression_diabetes

  results = regression_diabetes.main(str(tmp_path), steps=60)
  for row in ("ensemble", "ensemble_uniform", "fused"):
    assert np.isfinite(results[row]["nll"]) and 0.5 < results[row]["rmse"] < 1.0, results[row]
  assert len(results["particles"]["rmse"]) == 8


def test_video_example_on_mock_ucf101(tmp_path):
  tfds = pytest.importorskip("tensorflow_datasets")
  import video_ucf101

  with tfds.testing.mock_data(num_examples=8):
    results = video_ucf101.main(
      str(tmp_path),
      steps=2,
      num_frames=4,
      image_size=32,
      num_particles=4,
      global_batch_size=8,
      eval_batch_size=8,
      checkpoint_every_steps=-1,
      warmup_steps=1,
      log_every_steps=1,
    )
  assert len(results["particles"]["accuracy"]) == 4 and np.isfinite(results["ensemble"]["nll"])


def test_package_installs_and_runs_outside_the_checkout(tmp_path):
  """``pip install .`` into a fresh virtualenv (its dependencies from this environment, its build backend
  the ``setuptools`` of ``requirements.txt``), then ``ipf-train`` and an example from a directory that is not
  the checkout."""
  src = helpers.copy_checkout(tmp_path / "src")
  bin_dir = helpers.fresh_venv(tmp_path / "venv")
  venv, py, train = tmp_path / "venv", os.path.join(bin_dir, "python"), os.path.join(bin_dir, "ipf-train")
  r = subprocess.run(
    [py, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-q", str(src)],
    capture_output=True,
    text=True,
    env=helpers.venv_env(bin_dir),
  )
  assert r.returncode == 0, r.stdout + r.stderr
  away = tmp_path / "elsewhere"
  away.mkdir()
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH="")
  where = subprocess.run(
    [py, "-c", "import ipf_jax; print(ipf_jax.__file__)"], cwd=away, env=env, capture_output=True, text=True
  )
  assert str(venv) in where.stdout, where.stdout + where.stderr
  r = subprocess.run(
    [train, "--workdir", "run", "--config.num_train_steps=3", "--config.log_every_steps=1"],
    cwd=away,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert r.returncode == 0 and "final evaluation at step 3" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
  assert "mesh (particle, data)=(8, 1)" in r.stdout, "the installed digits config is the default"
  r = subprocess.run(
    [py, str(src / "examples" / "custom_model.py"), "--workdir", "custom", "--steps", "5"],
    cwd=away,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert r.returncode == 0 and "ensemble accuracy" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]

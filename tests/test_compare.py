"""``python -m ipf_jax.compare`` as a user runs it: every mode at equal compute in its own folder, one table
whose numbers are the runs' own final evaluations, one picture; a rerun only evaluates; a bad mode is one error."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests import helpers

pytestmark = pytest.mark.slow  # CI: leg 1 only (pytest.ini)

STEPS = 6


def run_compare(workdir, *flags):
  argv = [sys.executable, "-m", "ipf_jax.compare", "--config", "configs/digits.py", "--workdir", str(workdir)]
  argv += [helpers.TEST_CNN, f"--config.num_train_steps={STEPS}", *flags]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run(argv, cwd=helpers.ROOT, env=env, capture_output=True, text=True, timeout=900)


def test_compare_trains_each_mode_at_equal_compute_and_tabulates_their_own_results(tmp_path):
  r = run_compare(tmp_path, "--modes", "ddp,ensemble,ipf:qsr")
  assert r.returncode == 0, r.stdout + r.stderr
  rows = json.load(open(tmp_path / "compare.json"))
  assert [row["name"] for row in rows] == ["ddp", "ensemble", "ipf_qsr"]
  assert os.path.getsize(tmp_path / "compare.png") > 10_000
  configs = {row["name"]: json.load(open(tmp_path / row["name"] / "config.json")) for row in rows}
  assert {n: (c["mode"], c["num_particles"], c["sync"]) for n, c in configs.items()} == {
    "ddp": ("ddp", 1, "step"),
    "ensemble": ("ensemble", 8, "step"),
    "ipf_qsr": ("ipf", 8, "qsr"),
  }
  assert len({(c["global_batch_size"], c["num_train_steps"]) for c in configs.values()}) == 1, "equal compute"
  for row in rows:  # each number is the sub-run's own final evaluation, read back independently
    results = json.load(open(tmp_path / row["name"] / "eval_results.json"))
    assert results["step"] == STEPS
    np.testing.assert_allclose(row["accuracy"], results["ensemble"]["accuracy"], rtol=1e-6)
    np.testing.assert_allclose(row["ece"], results["ensemble"]["ece"], rtol=1e-6)
    one = results["fused"]["accuracy"] if row["name"] == "ipf_qsr" else np.mean(results["particles"]["accuracy"])
    np.testing.assert_allclose(row["one_model"], one, rtol=1e-6)
    assert f"{100 * row['accuracy']:.2f}%" in r.stdout.split("equal compute")[-1]
  assert rows[0]["disagreement"] is None and rows[1]["disagreement"] > 0
  # the same command again: every mode resumes at its last step and is only evaluated, with the same numbers
  again = run_compare(tmp_path, "--modes", "ddp,ensemble,ipf:qsr")
  assert again.returncode == 0, again.stdout + again.stderr
  assert again.stdout.count(f"at step {STEPS} (written on") == 3, again.stdout
  assert [row["accuracy"] for row in json.load(open(tmp_path / "compare.json"))] == [row["accuracy"] for row in rows]


@pytest.mark.parametrize("modes", ["ddp,dpp", "ddp,ddp", "ensemble:qsr"])
def test_compare_refuses_bad_modes_before_training_anything(tmp_path, modes):
  r = run_compare(tmp_path, "--modes", modes)
  assert r.returncode == 1, r.stdout + r.stderr
  assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
  assert "mode" in r.stderr or "sync" in r.stderr
  assert not any(p.is_dir() for p in tmp_path.iterdir()), "nothing trained"

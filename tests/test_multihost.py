"""Real multi-process runs on localhost (gloo CPU collectives): 2 processes x 2 devices."""
import os
import re
import shutil
import sys

import jax
import numpy as np

from tests import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 4 particles on a (particle, data) = (2, 2) mesh: on two hosts, each particle group spans one host.
FLAGS = ("--config.num_particles=4", "--config.particle_axis_size=2", "--config.log_every_steps=1",
         "--config.checkpoint_every_steps=0", "--config.temperature=10.0")


def run_two_hosts(workdir, steps):
  return helpers.run_processes([sys.executable, "train.py", "--config", "configs/digits.py", "--workdir",
                                str(workdir), *FLAGS, f"--config.num_train_steps={steps}",
                                "--config.num_cpu_devices=2"], 2)


def run_one_host(workdir, steps, devices):
  r = helpers.run_train_py(workdir, *FLAGS, f"--config.num_train_steps={steps}", f"--config.num_cpu_devices={devices}")
  assert r.returncode == 0, r.stdout + r.stderr
  return r.stdout


def step_lines(out):
  """(loss, ess, max_w) of every logged step."""
  return np.array([[float(x) for x in m] for m in
                   re.findall(r"step \d+/\d+ .*?loss ([\d.]+)  ess ([\d.]+)/\d+  max_w ([\d.]+)", out)])


def final_state(workdir, step):
  return helpers.load_checkpoint_numpy(workdir / "checkpoints" / str(step) / "state")


def test_two_hosts_equal_one_host_and_elastic_restore(tmp_path):
  single, multi = tmp_path / "single", tmp_path / "multi"
  out_single = run_one_host(single, 10, devices=4)
  out_hosts = run_two_hosts(multi, 10)
  assert "on 4 cpu device(s), 2 process(es)" in out_hosts[0]
  assert "final evaluation" in out_hosts[0] and "final evaluation" not in out_hosts[1], "only process 0 logs"
  assert not (multi / "train.log").read_text().count("step 1/10") > 1

  lines_single, lines_multi = step_lines(out_single), step_lines(out_hosts[0])
  assert lines_single.shape == (10, 3)
  np.testing.assert_allclose(lines_multi, lines_single, atol=2e-4)
  a, b = final_state(single, 10), final_state(multi, 10)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6), a, b)
  assert int(a.step if hasattr(a, "step") else a["step"]) == 10

  # Elastic: the 4-device checkpoint goes on on 2 hosts x 2 devices, then back on one host with 8 devices.
  elastic, reference = tmp_path / "elastic", tmp_path / "reference"
  shutil.copytree(single, elastic)
  shutil.copytree(single, reference)
  out = run_two_hosts(elastic, 14)[0]
  assert f"resumed from {elastic / 'checkpoints' / '10'} at step 10 (written on 4 device(s))" in out
  run_one_host(reference, 14, devices=4)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6),
               final_state(elastic, 14), final_state(reference, 14))
  out = run_one_host(elastic, 18, devices=8)
  assert f"resumed from {elastic / 'checkpoints' / '14'} at step 14 (written on 4 device(s))" in out
  assert "mesh (particle, data)=(2, 4) on 8 cpu device(s), 1 process(es)" in out

"""Real multi-process runs on localhost (gloo CPU collectives): 2 processes x 2 devices."""

import json
import os
import re
import shutil

import jax
import numpy as np
import pytest

from tests import helpers

pytestmark = pytest.mark.core  # CI: every leg (pytest.ini)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 4 particles on a (particle, data) = (2, 2) mesh: on two hosts, each particle group spans one host.
FLAGS = (
  "--config.num_particles=4",
  "--config.particle_axis_size=2",
  "--config.log_every_steps=1",
  "--config.checkpoint_every_steps=0",
  "--config.temperature=10.0",
)  # sync="auto": the outer loop (qsr), the default for a population; the fsdp test's runs are the per-step filter


def run_two_hosts(workdir, steps):
  return helpers.run_processes(
    helpers.train_py_argv(workdir, *FLAGS, f"--config.num_train_steps={steps}", "--config.num_cpu_devices=2"), 2
  )


def run_one_host(workdir, steps, devices, *more):
  r = helpers.run_train_py(
    workdir, *FLAGS, f"--config.num_train_steps={steps}", f"--config.num_cpu_devices={devices}", *more
  )
  assert r.returncode == 0, r.stdout + r.stderr
  return r.stdout


def step_lines(out):
  """(loss, ess, max_w) of every logged step."""
  return np.array(
    [[float(x) for x in m] for m in re.findall(r"step \d+/\d+ .*?loss ([\d.]+)  ess ([\d.]+)/\d+  max_w ([\d.]+)", out)]
  )


def final_state(workdir, step):
  return helpers.load_checkpoint_numpy(workdir / "checkpoints" / str(step) / "state")


STEPS = 24  # room for the preemption sync point, which lags a signal by about a second


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """A 2-host run and a 1-host 4-device run of the same config, never interrupted."""
  single, multi = tmp_path_factory.mktemp("single"), tmp_path_factory.mktemp("multi")
  return single, run_one_host(single, STEPS, devices=4), multi, run_two_hosts(multi, STEPS)


@pytest.mark.slow
def test_two_hosts_equal_one_host_and_elastic_restore(runs, tmp_path):
  single, out_single, multi, out_hosts = runs
  assert "on 4 cpu device(s), 2 process(es)" in out_hosts[0]
  assert "final evaluation" in out_hosts[0] and "final evaluation" not in out_hosts[1], "only process 0 logs"
  assert not (multi / "train.log").read_text().count(f"step 1/{STEPS}") > 1

  # The evaluation: each process read its own half of the test set; the results are the one host's.
  size = int(re.search(r"final evaluation at step \d+ on (\d+) digits test examples", out_single).group(1))
  assert f"on {size} digits test examples (process 0 read {(size + 1) // 2}: each process reads" in out_hosts[0]
  ev_single, ev_multi = (json.loads((w / "eval_results.json").read_text()) for w in (single, multi))
  for row in ("ensemble", "fused", "particles"):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5), ev_single[row], ev_multi[row])

  lines_single, lines_multi = step_lines(out_single), step_lines(out_hosts[0])
  assert lines_single.shape == (STEPS, 3)
  np.testing.assert_allclose(lines_multi, lines_single, atol=2e-4)
  a, b = final_state(single, STEPS), final_state(multi, STEPS)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6), a, b)

  # Elastic: the 4-device checkpoint goes on on 2 hosts x 2 devices, then back on one host with 8 devices.
  elastic, reference = tmp_path / "elastic", tmp_path / "reference"
  shutil.copytree(single, elastic)
  shutil.copytree(single, reference)
  out = run_two_hosts(elastic, STEPS + 4)[0]
  assert f"resumed from {elastic / 'checkpoints' / str(STEPS)} at step {STEPS} (written on 4 device(s))" in out
  assert "config differs from the checkpoint's in" in out and f"num_train_steps: {STEPS} -> {STEPS + 4}" in out
  run_one_host(reference, STEPS + 4, devices=4)
  jax.tree.map(
    lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6),
    final_state(elastic, STEPS + 4),
    final_state(reference, STEPS + 4),
  )
  out = run_one_host(elastic, STEPS + 8, devices=8)
  assert f"resumed from {elastic / 'checkpoints' / str(STEPS + 4)} at step {STEPS + 4} (written on 4 device(s))" in out
  assert "mesh (particle, data)=(2, 4) on 8 cpu device(s), 1 process(es)" in out


@pytest.mark.slow
def test_a_population_from_one_particle_of_a_checkpoint_on_two_hosts_equals_one_host(runs, tmp_path):
  """config.init_from with init_particle on 2 hosts: each process reads the particle from the 4-device run's
  checkpoint on the host (orbax, numpy) and the head starts fresh per particle; the run is the one host's."""
  single = runs[0]
  start = (f"--config.init_from={single}", "--config.init_particle=1", "--config.init_reinit=^Dense_0/")
  two, one = tmp_path / "two", tmp_path / "one"
  out = helpers.run_processes(
    helpers.train_py_argv(two, *FLAGS, *start, "--config.num_train_steps=2", "--config.num_cpu_devices=2"), 2
  )[0]
  assert f"every particle starts from particle 1 of the newest checkpoint in {single}; fresh per particle" in out
  r = helpers.run_train_py(one, *FLAGS, *start, "--config.num_train_steps=2", "--config.num_cpu_devices=4")
  assert r.returncode == 0, r.stdout + r.stderr
  np.testing.assert_allclose(step_lines(out), step_lines(r.stdout), atol=2e-4)
  jax.tree.map(
    lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6), final_state(two, 2), final_state(one, 2)
  )


@pytest.mark.slow
def test_sigterm_on_one_host_stops_both_at_one_step_then_resume_equals_uninterrupted(runs, tmp_path):
  """A preemption notice reaches one host: both save the same step (JAX's preemption sync point) and
  exit 143; the resumed run ends bit for bit where the uninterrupted one does."""
  import signal

  _, _, reference, out_reference = runs
  argv = helpers.train_py_argv(tmp_path, *FLAGS, f"--config.num_train_steps={STEPS}", "--config.num_cpu_devices=2")
  procs = helpers.start_processes(argv, 2)
  assert procs[0].wait_for(f"step 2/{STEPS}") is not None
  procs[1].signal(signal.SIGTERM)
  results = [p.finish() for p in procs]
  assert [rc for rc, _ in results] == [143, 143], results[0][1][-3000:]
  line = next(x for x in results[0][1].splitlines() if "stopped at step" in x)
  stopped = int(line.split("stopped at step ")[1].split()[0])
  assert "by SIGTERM (a preemption notice); checkpoint saved" in line and 2 <= stopped < STEPS
  assert os.listdir(tmp_path / "checkpoints") == [str(stopped)]
  out = run_two_hosts(tmp_path, STEPS)[0]
  assert f"resumed from {tmp_path / 'checkpoints' / str(stopped)} at step {stopped}" in out
  assert helpers.final_table(out) == helpers.final_table(out_reference[0])
  jax.tree.map(np.testing.assert_array_equal, final_state(tmp_path, STEPS), final_state(reference, STEPS))


def test_a_peer_that_never_starts_ends_the_run_with_one_line(tmp_path):
  import time

  port = helpers.free_port()
  t0 = time.monotonic()
  r = helpers.run_train_py(
    tmp_path / "w",
    "--config.num_cpu_devices=2",
    f"--coordinator_address=127.0.0.1:{port}",
    "--num_processes=2",
    "--process_id=0",
    "--startup_timeout=5",
  )
  assert r.returncode == 69 and time.monotonic() - t0 < 60, r.stdout + r.stderr
  assert (
    r.stderr.strip()
    .splitlines()[-1]
    .startswith(f"error: not every process of the run connected to the coordinator at 127.0.0.1:{port} within 5 s")
  )
  assert not (tmp_path / "w").exists()


def test_a_dead_peer_ends_the_survivor_within_a_minute(tmp_path):
  import signal
  import time

  argv = helpers.train_py_argv(
    tmp_path, *FLAGS, "--config.num_train_steps=2000", "--config.num_cpu_devices=2", "--peer_timeout=20"
  )
  procs = helpers.start_processes(argv, 2)
  try:
    assert procs[0].wait_for("step 5/2000") is not None
    procs[1].signal(signal.SIGKILL)
    t0 = time.monotonic()
    rc, out = procs[0].finish(timeout=120)
  finally:
    for p in procs:
      p.proc.kill()
  assert rc == 69 and time.monotonic() - t0 <= 60, out[-3000:]
  (error,) = [line for line in out.splitlines() if line.startswith("error: ")]
  assert "process" in error and "coordinator 127.0.0.1:" in error and "Rerun every process" in error


@pytest.mark.slow
def test_fsdp_on_two_hosts_equals_whole_particles_on_one(tmp_path):
  """config.fsdp on 2 hosts x 2 devices: each particle's blocks on the two devices of its host (its group),
  gathered for every forward pass and reduce-scattered after the backward, while resampling moves blocks
  between the hosts (gloo). The run (its steps, final state and evaluation) is the one-host run with whole
  particles. Both are the per-step filter (fsdp makes sync="auto" so; the fixture's runs are the outer loop's,
  which does not resample at sync_temperature=0)."""
  single, sharded = tmp_path / "single", tmp_path / "sharded"
  out_single = run_one_host(single, STEPS, 4, "--config.sync=step")
  argv = helpers.train_py_argv(sharded, *FLAGS, f"--config.num_train_steps={STEPS}", "--config.num_cpu_devices=2")
  out = helpers.run_processes(argv + ["--config.fsdp=True", "--config.fsdp_min_size_mb=0"], 2)[0]
  assert "mesh (particle, data)=(2, 2) on 4 cpu device(s), 2 process(es)" in out
  assert re.search(r"fsdp: [1-9]\d* of \d+ parameter and optimizer-state leaves \(\d+% of the bytes\) sharded", out)
  assert "; gathered whole for each forward pass" in out  # step.how_gathered, the step's own predicate
  np.testing.assert_allclose(step_lines(out), step_lines(out_single), atol=2e-4)
  assert int(re.findall(r"resamples (\d+)", out)[-1]) > 0, "the test must exercise resampling"
  jax.tree.map(
    lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6),
    final_state(sharded, STEPS),
    final_state(single, STEPS),
  )
  ev_whole, ev_sharded = (json.loads((w / "eval_results.json").read_text()) for w in (single, sharded))
  for row in ("ensemble", "fused", "particles"):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5), ev_sharded[row], ev_whole[row])

"""Faults during training, through the real trainer: a NaN particle, all NaN, a NaN step in DDP, bad workdirs."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import digits
from ipf_jax.runtime import trainer
from ipf_jax.runtime import workdir as workdir_lib
from tests import helpers

pytestmark = pytest.mark.slow  # CI: leg 1 only (pytest.ini)


def config(**kw):
  c = digits.get_config()
  c.num_train_steps = 12
  c.log_every_steps = 1
  c.checkpoint_every_steps = 5
  c.async_checkpointing = False
  c.cnn_features = helpers.TEST_FEATURES
  for k, v in kw.items():
    c[k] = v
  return c


def poison_params(state, particles):
  """NaN into every parameter of the given particles (a NaN only in an early
  layer can vanish: XLA's relu maps NaN to 0 on the CPU)."""
  chosen = jnp.zeros((state.log_weights.shape[0],), bool).at[jnp.asarray(particles)].set(True)
  return state.replace(
    params=jax.tree.map(lambda x: jnp.where(chosen.reshape((-1,) + (1,) * (x.ndim - 1)), jnp.nan, x), state.params)
  )


@pytest.mark.parametrize("sync, refilled", [("step", 8), ("qsr", 9)])
def test_nan_particle_is_culled_replaced_and_training_goes_on(tmp_path, capsys, sync, refilled):
  """The per-step filter refills the culled slot at the next step; the outer loop (the default for a population)
  at its next sync (step 8: sync_every=4), between syncs the others go on."""

  def hook(step, state, batch):
    if step == 6:
      state = poison_params(state, [2])
    return state, batch

  results = trainer.train_and_evaluate(config(ess_threshold=0.0, sync=sync), str(tmp_path), step_hook=hook)
  out = capsys.readouterr().out
  line = lambda step: out.split(f"step {step}/12")[1].splitlines()[0]
  assert "alive 7/8" in line(7) and all("alive 7/8" in line(s) for s in range(7, refilled))
  assert "alive 8/8" in line(refilled), "the culled slot is refilled at the next step or sync"
  assert np.all(np.isfinite(results["particles"]["accuracy"])) and np.all(np.isfinite(results["particles"]["nll"]))
  assert results["weights"].sum() == pytest.approx(1.0, rel=1e-5)
  assert "final evaluation" in open(tmp_path / "train.log").read()


def test_all_particles_nonfinite_stops_before_checkpointing(tmp_path):
  def hook(step, state, batch):
    return (poison_params(state, list(range(8))) if step == 7 else state), batch

  with pytest.raises(trainer.NonFiniteError, match="every particle's loss or gradient is non-finite"):
    trainer.train_and_evaluate(config(), str(tmp_path), step_hook=hook)
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["5"], "no checkpoint after the bad step; step 5 kept"


def test_ddp_skips_and_counts_a_nonfinite_step(tmp_path, capsys):
  def hook(step, state, batch):
    if step == 4:
      batch = dict(batch, image=batch["image"] * jnp.nan)
    return state, batch

  results = trainer.train_and_evaluate(config(num_particles=1), str(tmp_path), step_hook=hook)
  out = capsys.readouterr().out
  assert "skipped 1" in out.split("step 5/12")[1].splitlines()[0]
  assert "skipped 1" in out.split("step 12/12")[1].splitlines()[0], "only the bad step is skipped"
  assert np.isfinite(results["fused"]["nll"]) and results["fused"]["accuracy"] > 0.3


def test_workdir_parent_missing(tmp_path):
  with pytest.raises(trainer.WorkdirError, match="parent directory .* does not exist; create it first"):
    workdir_lib.prepare(str(tmp_path / "missing" / "run"))


def test_workdir_is_a_file(tmp_path):
  path = tmp_path / "file"
  path.write_text("x")
  with pytest.raises(trainer.WorkdirError, match="is a file, not a directory; choose another --workdir"):
    workdir_lib.prepare(str(path))


def test_bad_workdir_through_train_py(tmp_path):
  from tests.helpers import run_train_py

  r = run_train_py(tmp_path / "no" / "such" / "dir")
  assert r.returncode != 0 and "error: --workdir" in r.stderr and "does not exist" in r.stderr
  assert "Traceback" not in r.stderr

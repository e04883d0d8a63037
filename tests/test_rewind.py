"""Rewind on divergence (``config.rewind``): the watch's rule against a plain loop, and digits runs through the
real trainer with a fault injected once (the parameters scaled x30 at step 33: the loss jumps and stays up):
with rewind the run goes back to the checkpoint before the fault, skips the batches read since and ends with
an uninterrupted run's accuracy; without it the loss ends diverged; a rewound run stopped by SIGTERM resumes to
the same final state; past rewind_max it stops with one error."""

import json
import math
import os
import re
import signal

import jax
import numpy as np
import pytest

from configs import digits
from ipf_jax.config import read
from ipf_jax.errors import ConfigError
from ipf_jax.reporting import report
from ipf_jax.runtime import preemption, rewind, trainer
from tests import helpers

pytestmark = pytest.mark.slow  # CI: leg 1 only (pytest.ini)

FAULT_STEP = 33


def config(**kw):
  c = digits.get_config()
  c.num_train_steps, c.log_every_steps, c.checkpoint_every_steps, c.async_checkpointing = 80, 5, 10, False
  c.cnn_features, c.mode, c.num_particles = helpers.TEST_FEATURES, "ddp", 1
  c.rewind, c.rewind_window = True, 5
  c.update(kw)
  return c


def fault_once(fired: list, scale: float = 30.0):
  """Scales the parameters at FAULT_STEP, the first time only (a transient fault: a rewind trains past it)."""

  def hook(step, state, batch):
    if step == FAULT_STEP and not fired:
      fired.append(step)
      state = state.replace(params=jax.tree.map(lambda x: x * scale, state.params))
    return state, batch

  return hook


def fault_then_sigterm(stop_step: int):
  """``fault_once``, and SIGTERM to this process at ``stop_step`` (the run stops after it, saving)."""
  fault = fault_once([])

  def hook(step, state, batch):
    if step == stop_step:
      os.kill(os.getpid(), signal.SIGTERM)
    return fault(step, state, batch)

  return hook


def reference_rewind_step(losses, window, factor):
  """The first step (1-based) at which the rule fires, by a plain loop: an exponential average with weight
  1/window, its running minimum, and a count of consecutive steps with average > factor x minimum."""
  average, lowest, above = None, math.inf, 0
  for k, x in enumerate(losses, start=1):
    average = x if average is None else (1 - 1 / window) * average + x / window
    lowest = min(lowest, average)
    above = above + 1 if average > factor * lowest else 0
    if above >= window:
      return k
  return None


@pytest.mark.parametrize("window,factor", [(3, 2.0), (5, 1.5), (10, 3.0)])
def test_the_watch_fires_where_a_plain_loop_says(window, factor):
  rng = np.random.default_rng(window)
  losses = list(np.exp(-np.linspace(0, 2, 60)) + 0.05 * rng.random(60)) + list(4 + rng.random(40))
  want = reference_rewind_step(losses, window, factor)
  watch = rewind.Watch(window=window, loss_factor=factor, accuracy_drop=0.0)
  got = None
  for k, x in enumerate(losses, start=1):
    try:
      watch.loss(k, float(x))
    except rewind.Rewind as due:
      got = due.step
      break
  assert got == want and want is not None and want > 60


def test_an_accuracy_drop_fires_and_counts_stop_at_the_maximum():
  watch = rewind.Watch(window=5, loss_factor=2.0, accuracy_drop=5.0)
  watch.accuracy(10, 0.90)
  watch.accuracy(20, 0.86)  # 4 points: kept
  with pytest.raises(rewind.Rewind, match=r"fell more than 5 points below the run's best \(90.00%\)"):
    watch.accuracy(30, 0.84)
  watch.rewound(30, 20, max_rewinds=1)
  assert watch.record()["count"] == 1 and watch.record()["data_offset"] == 10
  with pytest.raises(rewind.DivergedError, match=r"diverged again after 1 rewind\(s\) \(config.rewind_max=1\)"):
    watch.rewound(40, 20, max_rewinds=1)


def meta(workdir, step):
  return json.load(open(os.path.join(workdir, "checkpoints", str(step), "meta", "metadata")))


def test_a_fault_is_rewound_and_the_run_ends_as_an_uninterrupted_one(tmp_path, capsys):
  clean = trainer.train_and_evaluate(config(rewind=False), str(tmp_path / "clean"))
  capsys.readouterr()
  off = trainer.train_and_evaluate(config(rewind=False), str(tmp_path / "off"), step_hook=fault_once([]))
  out_off = capsys.readouterr().out
  on = trainer.train_and_evaluate(config(), str(tmp_path / "on"), step_hook=fault_once([]))
  out = capsys.readouterr().out
  assert "rewound to the checkpoint of step 30, skipping the 10 batches read since (rewind 1 of at most 3)" in out
  assert abs(on["fused"]["accuracy"] - clean["fused"]["accuracy"]) < 0.02, (on["fused"], clean["fused"])
  assert on["fused"]["nll"] < 2 * clean["fused"]["nll"]
  last_loss = lambda text: float(text.split("step 80/80")[1].split("loss ")[1].split()[0])
  assert last_loss(out_off) > 10 * last_loss(out), "without rewind the loss ends diverged"
  assert off["fused"]["nll"] > 5 * clean["fused"]["nll"]
  assert {k: meta(tmp_path / "on", 80)["rewind"][k] for k in ("count", "data_offset")} == {
    "count": 1,
    "data_offset": 10,
  }
  assert "rewind" not in meta(tmp_path / "off", 80)


@pytest.mark.parametrize(
  "scale,kw",
  [
    (30.0, dict(checkpoint_every_minutes=1e-6)),  # a save every step by the timer: held while the loss is up
    (float("nan"), {}),  # DDP skips non-finite steps: every particle dead counts as a non-finite loss
  ],
  ids=["timer-saves-held", "nan"],
)
def test_the_checkpoint_it_goes_back_to_predates_the_fault(tmp_path, capsys, scale, kw):
  results = trainer.train_and_evaluate(config(**kw), str(tmp_path), step_hook=fault_once([], scale))
  out = capsys.readouterr().out
  rewound = re.findall(r"rewound to the checkpoint of step (\d+)", out)
  assert len(rewound) == 1 and int(rewound[0]) <= FAULT_STEP, out[-3000:]
  assert results["fused"]["accuracy"] > 0.9 and math.isfinite(results["fused"]["nll"])


@pytest.mark.parametrize("rewind_on_resume", [True, False])
def test_a_rewound_run_stopped_by_sigterm_resumes_to_the_same_state(tmp_path, rewind_on_resume):
  """With ``rewind_lr_factor=0.5``: after the rewind the rate is half the schedule's (the ``lr`` TensorBoard got
  against the schedule), and the resumed run trains at that rate too (bit for bit)."""
  whole = tmp_path / "whole"
  halved = lambda **kw: config(rewind_lr_factor=0.5, **kw)
  trainer.train_and_evaluate(halved(), str(whole), step_hook=fault_once([]))
  events = report.read_scalars(str(whole))["train/lr"]
  schedule = read.learning_rate_fn(halved(), *read.train_steps(halved(), 1))
  lr = {int(k): float(v) for k, v in zip(*events)}  # a replayed step: the value after the rewind
  for k in (20, 30, 60, 75):  # the rate reported at step k is the one of update k - 1
    np.testing.assert_allclose(lr[k], (0.5 if k > 30 else 1.0) * float(schedule(k - 1)), rtol=1e-5, err_msg=k)
  with pytest.raises(preemption.RunStopped):
    trainer.train_and_evaluate(halved(), str(tmp_path / "cut"), step_hook=fault_then_sigterm(55))
  assert {k: meta(tmp_path / "cut", 56)["rewind"][k] for k in ("count", "data_offset")} == {
    "count": 1,
    "data_offset": 10,
  }
  # the fault was met before the stop; with rewind off the resumed run still reads the data at the saved offset
  trainer.train_and_evaluate(halved(rewind=rewind_on_resume), str(tmp_path / "cut"))
  saved = lambda w: helpers.load_checkpoint_numpy(os.path.join(w, "checkpoints", "80", "state"))
  jax.tree.map(np.testing.assert_array_equal, saved(str(whole)), saved(str(tmp_path / "cut")))
  saved = lambda w: {k: meta(w, 80)["rewind"][k] for k in ("count", "data_offset")}
  assert saved(tmp_path / "cut") == saved(whole) == {"count": 1, "data_offset": 10}


def test_past_rewind_max_the_run_stops_with_one_error(tmp_path):
  def always(step, state, batch):  # a fault on every pass: the rewind meets it again
    if step == FAULT_STEP:
      state = state.replace(params=jax.tree.map(lambda x: x * 30.0, state.params))
    return state, batch

  with pytest.raises(trainer.DivergedError, match=r"diverged again after 1 rewind\(s\) \(config.rewind_max=1\)"):
    trainer.train_and_evaluate(config(rewind_max=1), str(tmp_path), step_hook=always)
  assert meta(tmp_path, 30)["step"] == 30, "the checkpoint before the fault is kept"


@pytest.mark.parametrize(
  "kw,match",
  [
    (dict(checkpoint_every_steps=0), "config.rewind: goes back to the newest checkpoint, but checkpoint_every"),
    (dict(rewind_accuracy_drop=-5.0), "config.rewind_accuracy_drop: -5.0 must be 0"),
    (dict(rewind_lr_factor=2.0), r"config.rewind_lr_factor: 2.0 must be in \(0, 1\]"),
    (dict(rewind_accuracy_drop=5.0, eval_every_steps=10, checkpoint_every_steps=5), "set checkpoint_every_steps to a"),
  ],
)
def test_rewind_config_errors_name_the_field(kw, match):
  with pytest.raises(ConfigError, match=match):
    trainer.check_run(config(**kw), "/tmp/unused")


def test_a_stop_inside_a_spike_is_judged_on_after_resume(tmp_path, capsys):
  """SIGTERM two steps into the spike: the stop's save is made (with a warning) and keeps the watch's numbers, so
  the resumed run still sees the spike and rewinds to the checkpoint before it."""
  with pytest.raises(preemption.RunStopped):
    trainer.train_and_evaluate(config(), str(tmp_path), step_hook=fault_then_sigterm(35))
  assert "step 36 is saved while the training loss is above rewind's line" in capsys.readouterr().out
  results = trainer.train_and_evaluate(config(), str(tmp_path))
  assert "rewound to the checkpoint of step 30" in capsys.readouterr().out
  assert results["fused"]["accuracy"] > 0.9

"""The outer loop (DESIGN.md §3b): its schedules, the SPMD program against the plain-loop reference on several
meshes, no collective over "particle" between syncs, and a killed run that resumes bit for bit."""

import os
import re
import signal

import jax
import numpy as np
import pytest

from ipf_jax.config import validation
from ipf_jax.population import outer
from tests import helpers
from tests.reference import OuterReference

pytestmark = pytest.mark.core  # CI: every leg (pytest.ini)

OUTER = dict(sync="every", sync_every=3, sync_examples=3, sync_pull=0.5, sync_temperature=4.0, forgetting=0.8)


def test_sync_schedules_against_their_rules_written_out():
  lr = lambda k: 0.4 * (1 - k / 100)  # 0.4 at 0, falling to 0 at 100
  every = outer.sync_steps("every", 10, 3, lr, 0, 0.0, 0.0)
  assert list(np.flatnonzero(every)) == [2, 5, 8, 9]  # every third step, and the last
  swap = outer.sync_steps("swap", 10, 1, lr, 0, 0.0, 0.3)
  assert list(np.flatnonzero(swap)) == [0, 1, 2, 9]
  # QSR: H_base = 2 through the warmup (5 steps), then max(2, floor((0.5 lr(5) / lr(k))^2)) after the sync at k.
  expected, k = [], 0
  while k < 100:
    h = 2 if k < 5 else max(2, int(np.floor((0.5 * lr(5) / lr(k)) ** 2))) if lr(k) > 0 else 10**9
    k += h
    if k <= 100:
      expected.append(k - 1)
  qsr = outer.sync_steps("qsr", 100, 2, lr, 5, 0.5, 0.0)
  assert list(np.flatnonzero(qsr)) == sorted(set(expected) | {99})
  gaps = np.diff(np.flatnonzero(qsr))
  assert gaps[0] == 2 and gaps[-1] > 8, "syncs grow rarer as the learning rate decays"


def run_both(config, dp, dd, num_steps):
  s = helpers.Setup(config, dp, dd)
  init = s.host_state()
  spec = validation.particle_spec(config)
  ref = OuterReference(
    s.plain_model,
    s.tx,
    spec,
    init.params,
    init.batch_stats,
    init.opt_state,
    init.log_weights,
    init.rng,
    outer_lr=config.outer_lr,
    outer_momentum=config.outer_momentum,
    opt_policy=config.sync_opt_state,
    sync_examples=config.sync_examples,
    data_devices=dd,
    sync_temperature=config.sync_temperature,
  )
  syncs = s.parts.train_step.syncs
  spmd_records, ref_records = [], []
  for k, (images, labels) in enumerate(helpers.particle_batches(config.num_particles, num_steps)):
    s.state, m = jax.block_until_ready(s.parts.step_at(k)(s.state, s.put(images, labels)))
    spmd_records.append(jax.device_get(m))
    gamma = 0.0 if k == len(syncs) - 1 else config.sync_pull
    ref_records.append(ref.train_step(images, labels, sync=bool(syncs[k]), gamma=gamma))
  return s, ref, spmd_records, ref_records


@pytest.mark.parametrize(
  "dp,dd,p,extra",
  [
    (8, 1, 8, {}),
    (4, 2, 8, dict(outer_lr=0.7, outer_momentum=0.9, sync_opt_state="average")),
    pytest.param(2, 4, 4, dict(sync_pull=1.0, sync_opt_state="reset"), marks=pytest.mark.slow),
    pytest.param(4, 2, 8, dict(islands=2, sync_temperature=20.0), marks=pytest.mark.slow),
    (1, 8, 1, dict(mode="ddp", outer_lr=0.7, outer_momentum=0.9)),  # Lookahead: one DDP model, an outer optimizer
  ],
)
def test_outer_loop_matches_reference(dp, dd, p, extra):
  """Seven steps, syncs after steps 3 and 6 and at the last (gamma = 0), a population or one DDP model: losses,
  the sync's scores, ESS and resampling decisions, and the final particles, anchor, outer momentum and weights
  agree with the loops (optimizer states kept, averaged, reset with their counts going on); so do the particles'
  distances to the anchor before each sync, the sync step's diversity in the log line."""
  config = helpers.tiny_config(num_particles=p, num_train_steps=7, **{**OUTER, "ess_threshold": 0.99, **extra})
  s, ref, spmd, refr = run_both(config, dp, dd, num_steps=7)
  assert p == 1 or sum(r["resampled"] for r in refr) >= 1, "the test must exercise resampling at a sync"
  for k, (m, r) in enumerate(zip(spmd, refr)):
    np.testing.assert_allclose(m["loss"], r["loss"], rtol=1e-4, atol=1e-5, err_msg=f"loss at step {k}")
    assert bool(m["resampled"]) == r["resampled"], f"resampling decision at step {k}"
    assert bool(m["synced"]) == ("ess" in r), f"sync at step {k}"
    if "ess" in r:
      np.testing.assert_allclose(m["score"], r["score"], rtol=1e-4, atol=1e-5, err_msg=f"scores at step {k}")
      np.testing.assert_allclose(m["ess"], r["ess"], rtol=1e-4, err_msg=f"ESS at step {k}")
      np.testing.assert_array_equal(m["ancestors"], r["ancestors"], err_msg=f"ancestors at step {k}")
      np.testing.assert_allclose(m["diversity"], r["diversity"], rtol=1e-4, err_msg=f"drift before the sync {k}")
      assert min(r["diversity"]) > 0, "the distances before the sync: after a pull of 1 they would be 0"
  final = s.host_state()
  params, batch_stats, opt_state = ref.stacked()
  helpers.assert_close(final.params, params)
  helpers.assert_close(final.batch_stats, batch_stats)
  helpers.assert_close(final.opt_state, opt_state)
  helpers.assert_close(final.anchor, ref.anchor)
  momentum = jax.tree.leaves(final.outer_opt_state)
  assert len(momentum) == (len(jax.tree.leaves(ref.momentum)) if config.outer_momentum else 0)
  if config.outer_momentum:
    helpers.assert_close(jax.tree.unflatten(jax.tree.structure(ref.momentum), momentum), ref.momentum)
  np.testing.assert_allclose(final.log_weights, ref.log_w, rtol=1e-4, atol=1e-5)
  assert int(final.num_resamples) == ref.num_resamples


COLLECTIVE = re.compile(r"= [^=]*\b(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(-start)?\(")


def collectives_across_particles(hlo: str, mesh) -> list[str]:
  """The compiled program's collectives whose device groups are not each inside one particle's data group.

  Two forms of ``replica_groups`` are read: the listed device ids (jax 0.10's XLA) and the mesh axes
  (``replica_groups=mesh['particle'=4,'data'=2] {'data'}``, jax 0.12's), which cross the particles iff
  they name the particle axis."""
  groups = [set(int(d.id) for d in row) for row in np.asarray(mesh.devices).reshape(mesh.devices.shape[0], -1)]
  found = []
  for line in hlo.splitlines():
    if not COLLECTIVE.search(line):
      continue
    over_axes = re.search(r"replica_groups=mesh\[[^\]]*\] \{([^}]*)\}", line)
    if over_axes is not None:
      axes = re.findall(r"'([^']*)'", over_axes.group(1))
      if not axes or mesh.axis_names[0] in axes:
        found.append(line.strip())
      continue
    listed = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line)
    if listed is None:
      found.append(line.strip())  # a form not read here counts as crossing
      continue
    members = [set(int(x) for x in g.split(",") if x) for g in re.findall(r"\{([\d,]*)\}", listed.group(1))]
    if not all(any(m <= g for g in groups) for m in members):
      found.append(line.strip())
  return found


@pytest.mark.parametrize("dp,dd", [(8, 1), (4, 2)])
def test_a_step_between_syncs_has_no_collective_over_particle(dp, dd):
  """The compiled local program has no collective across particles (its metrics leave sharded); the sync
  program has (the test can fail)."""
  config = helpers.tiny_config(num_particles=8, **OUTER)
  s = helpers.Setup(config, dp, dd)
  images, labels = helpers.particle_batches(8, 1)[0]
  batch = s.put(images, labels)
  local = s.parts.train_step.local.lower(s.state, batch).compile().as_text()
  assert collectives_across_particles(local, s.mesh) == []
  sync = s.parts.train_step.sync.lower(s.state, batch, np.float32(0.5)).compile().as_text()
  assert collectives_across_particles(sync, s.mesh), "the sync program must gather over the particles"


@pytest.mark.slow
def test_a_killed_outer_loop_run_resumes_bit_for_bit(tmp_path):
  """QSR with outer momentum and the filter: SIGKILL after step 11 of 16 (checkpoints every 4, syncs on both
  sides of the one resumed from), then the same command: the final checkpoint, anchor and its momentum included,
  equals an uninterrupted run's."""
  flags = (
    "--config.num_train_steps=16",
    "--config.checkpoint_every_steps=4",
    "--config.log_every_steps=1",
    "--config.sync=qsr",
    "--config.sync_every=2",
    "--config.outer_lr=0.7",
    "--config.outer_momentum=0.9",
    "--config.sync_temperature=10",
    "--config.ess_target=0.5",
  )
  whole = tmp_path / "whole"
  r = helpers.run_train_py(whole, *flags)
  assert r.returncode == 0, r.stdout + r.stderr
  killed = tmp_path / "killed"
  returncode = helpers.kill_train_py_at(killed, "step 11/16", *flags)
  assert returncode == -signal.SIGKILL, "the run must have been killed mid-way"
  saved = max(int(d) for d in os.listdir(killed / "checkpoints") if d.isdigit())
  assert 0 < saved < 16
  r = helpers.run_train_py(killed, *flags)
  assert r.returncode == 0, r.stdout + r.stderr
  assert f"resumed from {killed / 'checkpoints' / str(saved)} at step {saved}" in r.stdout
  a = helpers.load_checkpoint_numpy(killed / "checkpoints" / "16" / "state")
  b = helpers.load_checkpoint_numpy(whole / "checkpoints" / "16" / "state")
  assert "anchor" in a and "outer_opt_state" in a
  jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.mark.parametrize(
  "overrides,field",
  [
    (dict(sync="often"), "sync"),
    (dict(sync="qsr", mode="ensemble"), "sync"),
    (dict(sync="swap", mode="ddp", num_particles=1), "sync"),
    (dict(sync="every", mode="ddp", num_particles=1), "outer_lr"),  # outer_lr 1, no momentum, pull 1: plain DDP
    (dict(sync="every", sync_every=0), "sync_every"),
    (dict(sync="every", sync_pull=1.5), "sync_pull"),
    (dict(sync="every", shared_params="^Conv_0/"), "shared_params"),
    (dict(sync="every", dtype="float16"), "dtype"),
    (dict(sync="every", outer_momentum=1.0), "outer_momentum"),
    (dict(sync="every", sync_opt_state="drop"), "sync_opt_state"),
  ],
)
def test_outer_loop_config_errors_name_the_field(overrides, field):
  config = helpers.tiny_config(**{"num_particles": 8, **overrides})
  with pytest.raises(validation.ConfigError) as e:
    validation.validate(config, 8)
  assert e.value.field == field


def test_the_final_table_says_when_a_population_has_collapsed():
  """``tables.collapse_line``: members that disagree on fewer examples than a tenth of the ensemble's errors are
  called copies (the line names both numbers and the setting that keeps them apart); more, no line."""
  from ipf_jax.reporting import tables

  collapsed = {"diversity": {"disagreement": 0.004, "pairwise_kl": 0.001}, "ensemble": {"accuracy": 0.91}}
  line = tables.collapse_line(collapsed)
  assert "collapsed into copies" in line and "0.40%" in line and "9.00%" in line and "sync='qsr'" in line
  assert "sync_pull=0.5" in tables.collapse_line(collapsed, outer=True)  # the outer loop's own lever
  assert tables.collapse_line({**collapsed, "diversity": {"disagreement": 0.02}}) == ""
  assert tables.collapse_line({"ensemble": {"accuracy": 0.9}}) == ""  # no diversity measured: nothing said
  digits = {"diversity": {"disagreement": 0.0067}, "ensemble": {"accuracy": 0.9956}}  # the quickstart's table
  assert tables.collapse_line(digits) == ""

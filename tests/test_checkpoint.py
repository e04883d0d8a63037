"""Checkpoints: exact resume after SIGKILL, corrupt fallback, incompatible configs, resharded restore."""

import json
import os
import shutil
import signal
import subprocess

import jax
import numpy as np
import pytest

from configs import digits
from ipf_jax.config import validation
from ipf_jax.runtime import checkpoint as checkpoint_lib
from ipf_jax.runtime import compatibility
from ipf_jax.spmd import state as state_lib
from tests import helpers

pytestmark = pytest.mark.core  # CI: every leg (pytest.ini)

STEPS = 30
FLAGS = (f"--config.num_train_steps={STEPS}", "--config.checkpoint_every_steps=5", "--config.log_every_steps=1")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """A run that was never killed."""
  workdir = tmp_path_factory.mktemp("uninterrupted")
  r = helpers.run_train_py(workdir, *FLAGS)
  assert r.returncode == 0, r.stdout + r.stderr
  return workdir


def assert_same_state(a, b):
  jax.tree.map(np.testing.assert_array_equal, a, b)


def test_sigkill_and_resume_is_bit_exact(uninterrupted, tmp_path):
  returncode = helpers.kill_train_py_at(tmp_path, f"step 17/{STEPS}", *FLAGS)
  assert returncode == -signal.SIGKILL, "the run must have been killed mid-way"
  saved = sorted(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit())
  assert saved and max(saved) < STEPS
  r = helpers.run_train_py(tmp_path, *FLAGS)
  assert r.returncode == 0, r.stdout + r.stderr
  assert f"resumed from {tmp_path / 'checkpoints' / str(max(saved))} at step {max(saved)}" in r.stdout
  assert "config differs from the checkpoint's" not in r.stdout + r.stderr, "the same command changes nothing"
  assert_same_state(
    helpers.load_checkpoint_numpy(tmp_path / "checkpoints" / str(STEPS) / "state"),
    helpers.load_checkpoint_numpy(uninterrupted / "checkpoints" / str(STEPS) / "state"),
  )


@pytest.mark.slow
def test_corrupt_latest_checkpoint_falls_back_to_previous(uninterrupted, tmp_path):
  workdir = tmp_path / "w"
  shutil.copytree(uninterrupted, workdir)
  latest = workdir / "checkpoints" / str(STEPS)
  for dirpath, _, files in os.walk(latest / "state"):  # truncate every data file of the newest checkpoint
    for f in files:
      open(os.path.join(dirpath, f), "w").close()
  r = helpers.run_train_py(workdir, *FLAGS)
  assert r.returncode == 0, r.stdout + r.stderr
  assert f"checkpoint {latest} cannot be read" in r.stdout
  assert f"resumed from {workdir / 'checkpoints' / str(STEPS - 5)} at step {STEPS - 5}" in r.stdout
  assert (workdir / "checkpoints" / f"{STEPS}.unreadable").is_dir(), "the unreadable checkpoint must be kept"
  # Training the last 5 steps again reproduces the lost checkpoint exactly.
  assert_same_state(
    helpers.load_checkpoint_numpy(latest / "state"),
    helpers.load_checkpoint_numpy(uninterrupted / "checkpoints" / str(STEPS) / "state"),
  )


@pytest.mark.parametrize(
  "flag,field",
  [
    ("--config.num_particles=4", "num_particles"),
    ("--config.cnn_features=(16,32)", "cnn_features"),
    ("--config.momentum=0.0", "momentum"),
    ("--config.dtype=float16", "dtype"),
  ],
)
def test_incompatible_checkpoint_names_the_field(uninterrupted, tmp_path, flag, field):
  workdir = tmp_path / "w"
  shutil.copytree(uninterrupted, workdir)
  before = sorted(os.listdir(workdir / "checkpoints"))
  r = helpers.run_train_py(workdir, *FLAGS, flag)
  assert r.returncode != 0
  assert f"error: the checkpoint in {workdir / 'checkpoints' / str(STEPS)} does not fit this run's state" in r.stderr
  assert f"It was written with config.{field}=" in r.stderr and "Nothing was changed" in r.stderr
  assert "Traceback" not in r.stderr
  assert sorted(os.listdir(workdir / "checkpoints")) == before, "nothing saved may change"


@pytest.mark.parametrize("dp,dd", helpers.mark_slow([(4, 1), (2, 2), (1, 2), (8, 1)], "4-1", "1-2"))
def test_restore_reshards_onto_fewer_devices(tmp_path, dp, dd):
  saved, images, labels = helpers.saved_after_one_step(helpers.tiny_config(num_particles=8), 8, 1, tmp_path)

  target = helpers.tiny_config(num_particles=8)
  dst = helpers.Setup(target, dp, dd)
  abstract, _ = state_lib.train_state_init(
    jax.random.PRNGKey(0), dst.task, dst.tx, helpers.digits_data().example, 8, dst.mesh
  )
  restored, meta = checkpoint_lib.Checkpointer(str(tmp_path)).restore_latest(abstract, target)
  assert meta["num_devices"] == jax.device_count() and meta["particle_devices"] == 8  # saved on (8, 1)
  assert restored.params["Dense_0"]["kernel"].sharding.mesh.shape == {"particle": dp, "data": dd}
  assert_same_state(jax.device_get(restored), saved)
  dst.state, m = dst.train_step(restored, dst.put(images, labels))  # training goes on on the new mesh
  assert int(m["num_alive"]) == 8 and int(dst.state.step) == 2


def test_impossible_target_names_a_device_count_that_works():
  config = digits.get_config()
  config.num_devices = 3  # 8 particles on 3 devices: (Dp, Dd) = (1, 3) and 128 % 24 != 0
  with pytest.raises(validation.ConfigError, match=r"run on num_devices in \[1, 2, 4, 8\]"):
    validation.validate(config, 8)


@pytest.mark.slow
def test_float16_loss_scale_survives_a_restart(tmp_path):
  """The loss scale, its finite-step count and the overflow count are part of the saved state."""
  config = helpers.tiny_config(num_particles=4, dtype="float16", loss_scale_init=2.0**30, loss_scale_growth_interval=3)
  src = helpers.Setup(config, 4, 2)
  for images, labels in helpers.particle_batches(4, 20):
    src.state, _ = src.train_step(src.state, src.put(images, labels))
  saved = src.host_state()
  assert int(saved.num_overflows) > 0 and int(saved.dynamic_scale.fin_steps) > 0
  ckpt = checkpoint_lib.Checkpointer(str(tmp_path), async_save=False)
  ckpt.save(20, src.state, config)
  ckpt.close()
  dst = helpers.Setup(
    helpers.tiny_config(num_particles=4, dtype="float16", loss_scale_init=2.0**30, loss_scale_growth_interval=3), 2, 1
  )
  restored, _ = checkpoint_lib.Checkpointer(str(tmp_path)).restore_latest(dst.abstract, dst.config)
  assert_same_state(jax.device_get(restored), saved)
  assert restored.dynamic_scale.growth_interval == 3


def test_a_resume_onto_another_particle_mesh_is_said_with_local_placement():
  """``resample_placement="local"`` places copies by the particle mesh, so a resume onto another ``Dp`` is
  warned about (``trainer`` logs ``placement_note``); the ascending placement, the same ``Dp`` and a
  checkpoint that did not record its ``Dp`` say nothing."""
  local = helpers.tiny_config(resample_placement="local")
  note = compatibility.placement_note(local, {"particle_devices": 8}, 4)
  assert "written on 8 particle device(s), this run has 4" in note
  assert compatibility.placement_note(local, {"particle_devices": 4}, 4) is None
  assert compatibility.placement_note(local, {}, 4) is None
  assert compatibility.placement_note(helpers.tiny_config(), {"particle_devices": 8}, 4) is None


def test_changed_fields_lists_every_difference_from_the_saved_config():
  saved = digits.get_config()
  now = digits.get_config()
  now.islands, now.num_train_steps = 2, saved.num_train_steps + 10
  now.cnn_features, now.log_every_steps, now.num_cpu_devices = (16, 16, 32), 1, 2  # the last two: HOW_FIELDS
  assert compatibility.changed_fields(json.loads(saved.to_json()), now) == [
    "cnn_features: [32, 64, 128] -> [16, 16, 32]",
    "islands: 1 -> 2",
    f"num_train_steps: {saved.num_train_steps} -> {saved.num_train_steps + 10}",
  ]
  assert compatibility.changed_fields(json.loads(saved.to_json()), saved) == []
  assert compatibility.changed_fields({**json.loads(saved.to_json()), "gone": 1}, saved) == ["gone: 1 -> absent"]


@pytest.mark.parametrize(
  "flags, named, refusal",
  [
    (("--config.mode=ensemble",), ["config.mode='ipf'", "config.mode='ensemble'", "--config.mode='ipf'"], "fit"),
    (("--config.sync=every",), ["config.sync='qsr'", "config.sync='every'"], "meaning"),
  ],
)
def test_a_resume_that_changes_what_the_run_is_stops_and_touches_nothing(
  uninterrupted, tmp_path, flags, named, refusal
):
  """The trap of comparing modes in one workdir: a finished ipf run resumed with another mode would be evaluated
  and reported as that mode's. It stops with the fields named and the flag that resumes it, and nothing in the
  workdir changes: by the state's shapes (the default ipf run keeps an anchor an ensemble has not), or, where
  the shapes agree, by the fields that say what a run is (``sync='auto'`` compared as what it resolves to).
  (--dry_run and --eval_only read through the same check: ``checkpoint.check_latest``, ``restore_latest``.)"""
  workdir = tmp_path / "w"
  shutil.copytree(uninterrupted, workdir)
  files = lambda: {p: os.path.getmtime(os.path.join(d, p)) for d, _, ps in os.walk(workdir) for p in ps if p != ".lock"}
  before = files()  # the lock a training run takes and releases aside
  r = helpers.run_train_py(workdir, *FLAGS, *flags)
  assert r.returncode == 1, r.stdout + r.stderr
  words = {"fit": "does not fit this run's state", "meaning": "Resuming it would continue that run, not train this one"}
  assert words[refusal] in r.stderr and "Nothing was changed" in r.stderr, r.stderr
  for words in named:
    assert words in r.stderr, r.stderr
  assert "Traceback" not in r.stderr
  assert files() == before


def test_every_field_that_changes_what_a_run_is_is_named():
  """``check_meaning`` names each differing field of ``MEANING_FIELDS`` (all of them, not the first), ignores the
  others and fields an older checkpoint's config lacks."""
  saved = json.loads(digits.get_config().to_json())
  now = digits.get_config()
  now.weigh_on, now.sync, now.base_lr = "common", "step", 0.3
  with pytest.raises(compatibility.CheckpointError) as e:
    compatibility.check_meaning(saved, now, "w")
  assert "config.weigh_on='own', config.sync='qsr'" in str(e.value)  # "auto" named as what it resolves to
  assert "--config.weigh_on='own' --config.sync='qsr'" in str(e.value) and "base_lr" not in str(e.value)
  compatibility.check_meaning({k: v for k, v in saved.items() if k not in ("weigh_on", "sync")}, now, "w")
  now.weigh_on, now.sync = "own", "qsr"
  compatibility.check_meaning(saved, now, "w")  # base_lr alone: a resume may change it (and says so)
  again = digits.get_config()
  again.elastic_pull = 0.1  # "auto" resolves to "step" here: a per-step run saved so resumes with the defaults
  compatibility.check_meaning({**saved, "sync": "step", "elastic_pull": 0.1}, again, "w")


@pytest.mark.slow
def test_without_workdir_each_mode_trains_in_its_own_folder(tmp_path):
  """``train.py`` without ``--workdir`` (as its ``--help`` examples run): the folder is named after the config
  and the mode, so the deep-ensemble example after the quickstart trains an ensemble instead of resuming ipf."""
  from ipf_jax.config import sync as sync_lib
  from ipf_jax.runtime import cli

  config = digits.get_config()
  assert cli.default_workdir(config, "configs/digits.py") == os.path.join("runs", "digits_ipf_qsr")  # sync="auto"
  config.sync = "step"  # a per-step run, where the default put it before "auto"
  assert cli.default_workdir(config, "configs/digits.py") == os.path.join("runs", "digits_ipf")
  config.sync = "auto"
  config.mode = "ensemble"
  assert cli.default_workdir(config, "/x/configs/fashion_mnist.py") == os.path.join("runs", "fashion_mnist_ensemble")
  argv = helpers.train_py_argv("unused", "--config.num_train_steps=2", "--config.log_every_steps=1")
  argv = [a for a in argv if a not in ("--workdir", "unused")]
  argv[1:3] = [os.path.join(helpers.ROOT, "train.py"), "--config"]
  argv[3] = os.path.join(helpers.ROOT, "configs", "digits.py")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  r = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True)  # the config's mode, ipf
  assert r.returncode == 0, r.stdout + r.stderr
  saved = json.loads((tmp_path / "runs" / "digits_ipf_qsr" / "config.json").read_text())
  assert saved["mode"] == "ipf" and saved["sync"] == "qsr", "the program sync='auto' chose, recorded"
  assert sync_lib.recorded(config)["sync"] == "step"  # the ensemble's


def test_a_rerun_with_other_values_says_which_before_it_does_anything(uninterrupted):
  """``--dry_run`` on a finished run with another learning rate and retention: the plan names the field that
  decides what is trained, not the one that says how the run is run."""
  base_lr = digits.get_config().base_lr
  r = helpers.run_train_py(
    uninterrupted, *FLAGS, f"--config.base_lr={base_lr / 2}", "--config.keep_checkpoints=9", "--dry_run"
  )
  assert r.returncode == 0, r.stdout + r.stderr
  assert (
    f"with this run's values of the 1 config field(s) that differ from the checkpoint's "
    f"(base_lr: {base_lr!r} -> {base_lr / 2!r})"
  ) in r.stdout + r.stderr


def test_damage_is_decided_by_the_files_listed_at_commit(uninterrupted, tmp_path):
  """Each committed checkpoint lists its files and sizes; a listed file missing or of another size is
  damage, found without orbax. Without the list (a run cut off right after a commit) the two metadata
  files must parse."""
  path = tmp_path / "30"
  shutil.copytree(uninterrupted / "checkpoints" / str(STEPS), path)
  written = json.load(open(path / checkpoint_lib.FILE_LIST))
  assert written == checkpoint_lib.list_files(str(path)) and "state/_METADATA" in written and len(written) > 5
  assert checkpoint_lib.damage(str(path)) is None
  largest = max(written, key=written.get)
  os.truncate(path / largest, written[largest] // 2)
  assert checkpoint_lib.damage(str(path)) == (
    f"{largest} holds {written[largest] // 2} bytes, written as {written[largest]} (truncated or changed)"
  )
  os.truncate(path / largest, written[largest])  # the size back (zeros): bytes that changed are not seen here
  os.remove(path / "state" / "_sharding")
  assert checkpoint_lib.damage(str(path)) == "state/_sharding is missing"
  os.remove(path / checkpoint_lib.FILE_LIST)
  assert checkpoint_lib.damage(str(path)) is None
  open(path / "meta" / "metadata", "w").write('{"step": 3')
  assert checkpoint_lib.damage(str(path)) == "meta/metadata cannot be read (JSONDecodeError)"
  open(path / checkpoint_lib.FILE_LIST, "w").write("[1, 2")  # a damaged list: judged as no list
  assert checkpoint_lib.damage(str(path)) == "meta/metadata cannot be read (JSONDecodeError)"


@pytest.mark.slow
def test_a_restore_that_fails_for_another_reason_stops_and_moves_nothing(uninterrupted, tmp_path, monkeypatch):
  """Files that check out but a restore that fails (here: out of memory) is not damage: one error naming
  the checkpoint, nothing set aside, whatever the error's words."""
  import orbax.checkpoint as ocp

  workdir = tmp_path / "w"
  shutil.copytree(uninterrupted, workdir)
  before = sorted(os.listdir(workdir / "checkpoints"))
  config = digits.get_config()
  config.update(json.load(open(workdir / "config.json")))
  s = helpers.Setup(config, 8, 1)

  def restore(self, *args, **kwargs):
    raise MemoryError("DATA_LOSS: not found")  # words the old message matching took for damage

  monkeypatch.setattr(ocp.StandardCheckpointer, "restore", restore)
  with pytest.raises(
    compatibility.CheckpointError,
    match=rf"cannot restore {workdir / 'checkpoints' / str(STEPS)}: "
    r"MemoryError: DATA_LOSS: not found\. The checkpoint was left as it is",
  ):
    checkpoint_lib.Checkpointer(str(workdir)).restore_latest(s.abstract, config)
  assert sorted(os.listdir(workdir / "checkpoints")) == before
  # The same checkpoint without its list (cut off after the commit) restores, and gets its list then.
  monkeypatch.undo()
  newest = workdir / "checkpoints" / str(STEPS)
  written = json.load(open(newest / checkpoint_lib.FILE_LIST))
  os.remove(newest / checkpoint_lib.FILE_LIST)
  _, meta = checkpoint_lib.Checkpointer(str(workdir)).restore_latest(s.abstract, config)
  assert meta["step"] == STEPS and json.load(open(newest / checkpoint_lib.FILE_LIST)) == written
  assert sorted(os.listdir(workdir / "checkpoints")) == before, "nothing else written beside the checkpoints"

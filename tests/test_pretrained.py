"""A population started from one checkpoint (config.init_from, init_reinit): what is loaded, what starts
fresh, and the errors for files that do not fit, against the values read back with numpy."""

import json

import jax
import numpy as np
import pytest
from flax import serialization, traverse_util

import ipf_jax
from ipf_jax.errors import ConfigError
from ipf_jax.spmd import sharing
from tests import helpers

pytestmark = pytest.mark.core  # CI: every leg (pytest.ini)


def config_for(**overrides):
  config = helpers.tiny_config(num_particles=4, global_batch_size=16, **overrides)
  config.num_devices = 4
  return config


def first_state(config, num_classes=10):
  from ipf_jax.config import builder

  task = builder.zoo_task(config, num_classes)
  example = {"image": np.zeros((1, 8, 8, 1), np.float32), "label": np.zeros((1,), np.int32)}
  parts = ipf_jax.build(config, task, example)
  state = jax.device_get(parts.init_state())
  return state, traverse_util.flatten_dict(sharing.merge(state.params, state.shared_params), sep="/")


def write_export(tmp_path, num_classes=10):
  """A fused model as the trainer exports it (msgpack of params and batch_stats), from a fresh CNN."""
  from ipf_jax.models.cnn import CNN

  variables = CNN(num_classes=num_classes, features=(4, 8)).init(
    jax.random.PRNGKey(7), np.zeros((1, 8, 8, 1), np.float32), train=False
  )
  variables = jax.tree.map(lambda x: np.asarray(x) + 0.25, variables)  # not any init this test makes
  path = tmp_path / "fused_model"
  (tmp_path / "fused_model.msgpack").write_bytes(serialization.msgpack_serialize(variables))
  return str(path), traverse_util.flatten_dict(variables["params"], sep="/")


def test_every_particle_starts_from_the_export_but_the_head_fresh_and_its_own(tmp_path):
  path, saved = write_export(tmp_path)
  state, params = first_state(config_for(init_from=path, init_reinit="^Dense_0/", mode="ensemble"))
  for name, value in saved.items():
    if name.startswith("Dense_0/"):
      assert not np.allclose(params[name][0], value), name  # fresh
      if name.endswith("kernel"):  # (biases start at zero)
        assert not np.allclose(params[name][0], params[name][1]), "ensemble: each particle its own init"
    else:
      np.testing.assert_array_equal(params[name], np.broadcast_to(value, params[name].shape), err_msg=name)
  # the batch statistics of the export too, and the optimizer state fresh (zeros: SGD momentum)
  np.testing.assert_array_equal(state.batch_stats["BatchNorm_0"]["mean"][2], np.zeros(4) + 0.25)
  assert all(not np.any(x) for x in jax.tree.leaves(state.opt_state))


def test_a_workdir_an_npz_and_shared_parameters_with_adamw(tmp_path):
  """The run's workdir names its fused model; an .npz of /-joined names (params/ prefix, as big_vision's)
  loads the same values; shared parameters and AdamW's state start from them."""
  path, saved = write_export(tmp_path)
  _, from_workdir = first_state(config_for(init_from=str(tmp_path)))
  np.savez(tmp_path / "flat.npz", **{f"params/{k}": v for k, v in saved.items()})
  config = config_for(init_from=str(tmp_path / "flat.npz"), shared_params="^Conv_0/", optimizer="adamw")
  state, from_npz = first_state(config)
  for name in saved:  # (a shared leaf is stored once, a particle's leaf once per particle)
    np.testing.assert_array_equal(np.broadcast_to(from_npz[name], from_workdir[name].shape), from_workdir[name])
  np.testing.assert_array_equal(state.shared_params["Conv_0"]["kernel"], saved["Conv_0/kernel"])


def test_a_file_that_does_not_fit_names_its_parameters_and_the_fix(tmp_path):
  path, _ = write_export(tmp_path, num_classes=7)
  with pytest.raises(ConfigError, match=r"config.init_from: .* Dense_0/bias \(7,\) there, \(10,\) here.*init_reinit"):
    first_state(config_for(init_from=path))
  first_state(config_for(init_from=path, init_reinit="^Dense_0/"))  # a new label set: the head fresh
  with pytest.raises(ConfigError, match="file lacks: Conv_1/kernel"):
    np.savez(tmp_path / "part.npz", **{"Conv_0/kernel": np.zeros((3, 3, 1, 4), np.float32)})
    first_state(config_for(init_from=str(tmp_path / "part.npz"), init_reinit="^(Dense|BatchNorm)"))
  with pytest.raises(ConfigError, match="config.init_from: .*nowhere.* is neither a file"):
    first_state(config_for(init_from=str(tmp_path / "nowhere")))
  with pytest.raises(ConfigError, match="config.init_reinit: is not a valid regular expression"):
    first_state(config_for(init_from=path, init_reinit="("))


@pytest.mark.slow
def test_train_py_fine_tunes_a_population_from_another_runs_fused_model(tmp_path):
  """The user's path: one run trains and exports, the next starts 4 particles from its fused model with a
  fresh head, trains and evaluates."""
  first = helpers.run_train_py(tmp_path / "first", "--config.num_train_steps=4", "--config.checkpoint_every_steps=-1")
  assert first.returncode == 0, first.stderr[-3000:]
  second = helpers.run_train_py(
    tmp_path / "second",
    f"--config.init_from={tmp_path / 'first'}",
    "--config.init_reinit=^Dense_0/",
    "--config.num_train_steps=4",
    "--config.num_particles=4",
    "--config.optimizer=adamw",
    "--config.base_lr=0.001",
    "--config.checkpoint_every_steps=-1",
  )
  assert second.returncode == 0, second.stderr[-3000:]
  assert "final evaluation at step 4" in second.stdout


def test_one_particle_of_another_runs_newest_checkpoint(tmp_path):
  """init_particle = i: every particle starts from particle i of the workdir's newest checkpoint, its
  shared parameters merged back and its batch statistics with it; an index the run lacks is one error."""
  from ipf_jax.config import builder
  from ipf_jax.runtime import checkpoint

  source = config_for(mode="ensemble", shared_params="^Conv_0/")  # independent inits: the particles differ
  task = builder.zoo_task(source, 10)
  example = {"image": np.zeros((1, 8, 8, 1), np.float32), "label": np.zeros((1,), np.int32)}
  state = ipf_jax.build(source, task, example).init_state()
  state = state.replace(
    batch_stats=jax.tree.map(lambda x: x + np.arange(4).reshape((4,) + (1,) * (x.ndim - 1)), state.batch_stats)
  )
  for step in (3, 5):  # the newest is read
    ckpt = checkpoint.Checkpointer(str(tmp_path), async_save=False)
    ckpt.save(step, jax.tree.map(lambda x, s=step: x * (s == 5), state) if step == 3 else state, source)
    ckpt.close()
  saved = jax.device_get(state)
  want = traverse_util.flatten_dict(
    sharing.merge(jax.tree.map(lambda x: x[2], saved.params), saved.shared_params), sep="/"
  )
  _, params = first_state(config_for(init_from=str(tmp_path), init_particle=2, init_reinit="^Dense_0/"))
  for name, value in want.items():
    if not name.startswith("Dense_0/"):
      np.testing.assert_array_equal(params[name], np.broadcast_to(value, params[name].shape), err_msg=name)
  assert not np.allclose(params["Dense_0/kernel"][0], want["Dense_0/kernel"])  # the head fresh
  started, _ = first_state(config_for(init_from=str(tmp_path), init_particle=2))
  np.testing.assert_array_equal(
    started.batch_stats["BatchNorm_0"]["mean"][1], saved.batch_stats["BatchNorm_0"]["mean"][2]
  )
  with pytest.raises(ConfigError, match="config.init_particle: must be < 4"):
    first_state(config_for(init_from=str(tmp_path), init_particle=4))
  with pytest.raises(ConfigError, match="config.init_particle: .*holds no whole checkpoint"):
    first_state(config_for(init_from=str(tmp_path / "checkpoints" / "nowhere"), init_particle=0))
  # The newest damaged (a file cut short): the older one (all zeros) is read, as a resume would.
  listed = json.load(open(tmp_path / "checkpoints" / "5" / "files.json"))
  largest = max(listed, key=listed.get)
  open(tmp_path / "checkpoints" / "5" / largest, "r+b").truncate(listed[largest] // 2)
  started, _ = first_state(config_for(init_from=str(tmp_path), init_particle=2))
  assert all(not np.any(x) for x in jax.tree.leaves(started.params)), "step 3's particle, not the damaged step 5's"
  open(tmp_path / "checkpoints" / "3" / "files.json", "w").write('{"missing": 1}')
  with pytest.raises(ConfigError, match=r"holds no whole checkpoint .*only damaged ones \(step 5: .* step 3: missing"):
    first_state(config_for(init_from=str(tmp_path), init_particle=2))


@pytest.mark.parametrize("saved_scan,model_scan", [(False, True), (True, False)])
def test_a_vit_s_blocks_load_into_the_other_layout(tmp_path, saved_scan, model_scan):
  """A ViT checkpoint of unrolled blocks (``encoderblock_{i}``, big_vision's layout) starts a scanned model
  (``vit_scan``: the blocks stacked), and a scanned one an unrolled model: every block's values where the
  other layout keeps them (``np.stack`` by hand). A file of another depth is named, not cut or padded."""
  from ipf_jax.models import vit
  from ipf_jax.spmd import pretrained

  small = dict(num_classes=5, patch_size=4, width=16, mlp_dim=32, num_heads=2)
  x = np.zeros((1, 8, 8, 3), np.float32)
  unrolled = jax.device_get(vit.ViT(**small, depth=3).init(jax.random.key(0), x)["params"])
  flat = traverse_util.flatten_dict(unrolled, sep="/")
  stacked = dict(flat)
  for name in list(stacked):
    if name.startswith("Transformer/encoderblock_0/"):
      rest = name.split("/", 2)[2]
      stacked[f"Transformer/encoderblock/{rest}"] = np.stack(
        [stacked.pop(f"Transformer/encoderblock_{i}/{rest}") for i in range(3)]
      )
  saved, want = (stacked, flat) if saved_scan else (flat, stacked)
  np.savez(tmp_path / "vit.npz", **{f"params/{k}": v for k, v in saved.items()})
  model = vit.ViT(**small, depth=3, scan=model_scan)
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(1), x))
  start = pretrained.for_model(str(tmp_path / "vit.npz"), "", shapes)["params"]
  assert sorted(start) == sorted(want)
  for name in want:
    np.testing.assert_array_equal(start[name], want[name])
  deeper = vit.ViT(**small, depth=4, scan=model_scan)
  with pytest.raises(ConfigError, match="config.init_from: .* does not fit this model: .*encoderblock"):
    pretrained.for_model(str(tmp_path / "vit.npz"), "", jax.eval_shape(lambda: deeper.init(jax.random.key(1), x)))

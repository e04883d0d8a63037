"""Flax NNX modules as a library user brings them: ``Task(model=nnx_module)`` trains the same step as the
same network written in Linen, on several meshes; instances and constructors initialise as documented;
the library path trains one with dropout and ``load_fused`` gives back an NNX module to call."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ipf_jax
from ipf_jax.config import validation
from ipf_jax.spmd.mesh import DATA
from tests import helpers

pytestmark = pytest.mark.core  # CI: every leg (pytest.ini)

HIDDEN = 16


class LinenNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Dense(HIDDEN, name="hidden")(x.reshape(x.shape[0], -1))
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5, axis_name=DATA, name="bn")(x)
    return nn.Dense(10, name="out")(nn.relu(x))


class NNXNet(nnx.Module):
  """``LinenNet`` in NNX: the same parameter and statistics names, shapes and initialisers."""

  def __init__(self, rngs: nnx.Rngs, inputs: int = 64):
    self.hidden = nnx.Linear(inputs, HIDDEN, rngs=rngs)
    self.bn = nnx.BatchNorm(HIDDEN, momentum=0.9, epsilon=1e-5, axis_name=DATA, rngs=rngs)
    self.out = nnx.Linear(HIDDEN, 10, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.bn(self.hidden(x.reshape(x.shape[0], -1)))))


class TwoDropouts(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.first, self.second = nnx.Dropout(0.5, rngs=rngs), nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x):
    return jnp.stack([self.first(x), self.second(x)])


def test_each_dropout_layer_draws_its_own_mask():
  task = ipf_jax.classification(TwoDropouts(nnx.Rngs(0)))
  x = jnp.ones((4, 64))
  out = task.apply({"params": {}}, {"image": x}, train=True, key=jax.random.PRNGKey(1))[0]
  assert float(jnp.abs(out[0] - out[1]).max()) > 0, "two layers of one stream share no mask"
  np.testing.assert_array_equal(task.apply({"params": {}}, {"image": x}, train=False), jnp.stack([x, x]))


class NNXDropoutMLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(64, 64, rngs=rngs)
    self.drop = nnx.Dropout(0.2, rngs=rngs)
    self.out = nnx.Linear(64, 10, rngs=rngs)

  def __call__(self, x):
    return self.out(self.drop(nnx.relu(self.hidden(x.reshape(x.shape[0], -1)))))


@pytest.mark.parametrize("dp,dd,p", helpers.mark_slow([(8, 1, 8), (4, 2, 4), (2, 4, 4)], "8-1-8", "2-4-4"))
def test_nnx_and_linen_versions_of_one_network_take_the_same_steps(dp, dd, p):
  """From one state, three ipf steps (weights, correction, resampling, SyncBN over ``"data"``): the NNX
  task's state equals the Linen task's."""
  settings = dict(num_particles=p, init="shared", temperature=2.0, jitter=0.0, resample_every=2)
  linen = helpers.Setup(helpers.tiny_config(**settings), dp, dd, task=ipf_jax.classification(LinenNet()))
  nnx_setup = helpers.Setup(helpers.tiny_config(**settings), dp, dd, task=ipf_jax.classification(NNXNet(nnx.Rngs(0))))
  assert jax.tree.structure(linen.state) == jax.tree.structure(nnx_setup.state)
  a, b = linen.state, jax.tree.map(lambda x: x.copy(), linen.state)  # the steps donate their input state
  for images, labels in helpers.particle_batches(p, 3):
    a, ma = linen.train_step(a, linen.put(images, labels))
    b, mb = nnx_setup.train_step(b, nnx_setup.put(images, labels))
    helpers.assert_close(np.asarray(mb["loss"]), np.asarray(ma["loss"]))
  helpers.assert_close(jax.device_get(b.params), jax.device_get(a.params))
  helpers.assert_close(jax.device_get(b.batch_stats), jax.device_get(a.batch_stats))
  helpers.assert_close(np.asarray(b.log_weights), np.asarray(a.log_weights))
  assert int(a.num_resamples) > 0, "the steps should include a resampling"


def test_an_instance_gives_every_particle_its_values():
  module = NNXNet(nnx.Rngs(7))
  s = helpers.Setup(helpers.tiny_config(num_particles=8, init="shared"), 8, 1, task=ipf_jax.classification(module))
  kernel = np.asarray(s.state.params["hidden"]["kernel"])
  assert kernel.shape == (8, 64, HIDDEN)
  for i in range(8):
    np.testing.assert_array_equal(kernel[i], np.asarray(module.hidden.kernel[...]))
  np.testing.assert_array_equal(np.asarray(s.state.batch_stats["bn"]["var"]), np.ones((8, HIDDEN)))


def test_a_constructor_gives_each_particle_its_own_init_and_an_instance_is_refused_there():
  s = helpers.Setup(
    helpers.tiny_config(num_particles=4, mode="ensemble"), 4, 1, task=ipf_jax.classification(lambda rngs: NNXNet(rngs))
  )
  kernel = np.asarray(s.state.params["hidden"]["kernel"])
  assert all(np.abs(kernel[i] - kernel[j]).max() > 1e-3 for i in range(4) for j in range(i))
  with pytest.raises(validation.ConfigError, match=r"config.init: .*nnx.Module instance.*lambda rngs"):
    helpers.Setup(
      helpers.tiny_config(num_particles=4, mode="ensemble"), 4, 1, task=ipf_jax.classification(NNXNet(nnx.Rngs(0)))
    )


def test_blocks_are_refused_for_an_nnx_model():
  """``Task.blocks`` (``fsdp_gather="block"``) needs blocks built by ``models.blocks.make``, which are linen:
  an NNX model that declares ``BLOCKS`` is refused when the task is made, naming the field."""

  class NNXWithBlocks(NNXNet):
    BLOCKS = r"layer_\d+"

  with pytest.raises(ValueError, match=r"Task.blocks='layer_\\\\d\+': an NNX model's blocks cannot gather"):
    ipf_jax.classification(NNXWithBlocks(nnx.Rngs(0)))


def test_a_module_that_is_not_flax_is_one_clear_error():
  with pytest.raises(TypeError, match="neither a Flax Linen module, an nnx.Module, nor a constructor"):
    ipf_jax.classification(lambda rngs: 3)


def test_nnx_dropout_model_trains_through_the_library_and_loads_as_nnx(tmp_path):
  """The README's NNX program: dropout keyed per particle (masks differ between particles and steps),
  the run's table, and ``load_fused`` returning an ``nnx.Module`` whose predictions score as the table's
  fused row."""
  data = helpers.digits_data()
  train, test = data.train, data.test
  arrays = ipf_jax.ArrayDataset("digits (NNX)", train=train, test=test, num_classes=10)
  task = ipf_jax.classification(lambda rngs: NNXDropoutMLP(rngs))
  assert task.rngs == ("default",)
  x = jnp.asarray(test["image"][:32])
  variables = task.init(jax.random.PRNGKey(0), {"image": x})
  draws = [task.apply(variables, {"image": x}, train=True, key=jax.random.PRNGKey(k))[0] for k in (1, 2)]
  assert float(jnp.abs(draws[0] - draws[1]).max()) > 0, "dropout masks come from the key"
  np.testing.assert_array_equal(
    task.apply(variables, {"image": x}, train=False), task.apply(variables, {"image": x}, train=False)
  )
  config = ipf_jax.default_config()
  config.num_particles, config.global_batch_size, config.num_train_steps = 8, 128, 120
  config.base_lr, config.log_every_steps, config.checkpoint_every_steps = 0.5, 60, -1
  results = ipf_jax.train_and_evaluate(config, str(tmp_path / "run"), task=task, data=arrays)
  assert results["ensemble"]["accuracy"] > 0.85, results["ensemble"]
  module, fused = ipf_jax.load_fused(str(tmp_path / "run" / "fused_model"), model=lambda rngs: NNXDropoutMLP(rngs))
  assert isinstance(module, nnx.Module)
  logits = np.asarray(module(jnp.asarray(test["image"])))
  accuracy = float(np.mean(logits.argmax(-1) == test["label"]))
  assert abs(accuracy - results["fused"]["accuracy"]) < 1e-6, (accuracy, results["fused"])

"""Options that keep the population diverse (issue: Uncertainty), against numpy: the ESS-targeted
temperature (pure function and inside the step on two meshes), the learning-rate-scaled jitter, and the
seed's recipe (rho = 0, lr = base_lr sqrt(devices x P))."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ipf_jax.config import read, validation
from ipf_jax.population import particle_filter as pf
from ipf_jax.spmd import optim
from ipf_jax.spmd import step as step_lib
from tests import helpers

pytestmark = pytest.mark.slow  # CI: leg 1 only (pytest.ini)


def np_ess(prev, loss, alive, tau, rho):
  raw = np.where(alive, rho * prev - tau * np.where(alive, loss, 0), -np.inf)
  w = np.exp(raw - raw[alive].max())
  w = w / w.sum()
  return 1.0 / np.sum(w**2)


@pytest.mark.parametrize("seed", range(4))
def test_adaptive_temperature_is_the_largest_that_keeps_the_ess(seed):
  rng = np.random.default_rng(seed)
  p = 16
  prev = np.log(rng.dirichlet(np.ones(p)))
  loss = rng.gamma(2.0, 0.5, p)
  alive = rng.random(p) > 0.1
  rho, tau_max, target = 0.9, 50.0, 0.5 * alive.sum() * 0.8
  tau = float(
    pf.adaptive_temperature(
      jnp.asarray(prev, jnp.float32), jnp.asarray(loss, jnp.float32), jnp.asarray(alive), tau_max, rho, target
    )
  )
  grid = np.linspace(0, tau_max, 20001)  # brute force: the largest grid tau that keeps the ESS
  ok = np.array([np_ess(prev, loss, alive, t, rho) >= target for t in grid])
  if ok.all():
    assert tau == tau_max
  elif not ok[0]:  # the previous weights alone are below the target: no reweighting by the loss
    assert tau == 0.0
  else:
    best = grid[np.argmin(ok)]  # the first failing grid point bounds tau from above
    assert np_ess(prev, loss, alive, tau, rho) >= target - 1e-3
    assert abs(tau - best) <= 2 * tau_max / 20000 + 1e-4 * tau_max, (tau, best)


@pytest.mark.parametrize("dp,dd", [(2, 4)])  # weigh_on=common below runs on (8, 1) and (4, 2)
def test_step_with_ess_target_reweighs_with_the_adaptive_temperature(dp, dd):
  """Each step: tau_t <= temperature, the weights are rho log w - tau_t loss normalised, and their ESS
  is at the target (or tau_t = temperature already keeps it); ``temperature`` is in the metrics."""
  p = 8
  config = helpers.tiny_config(
    num_particles=p, ess_target=0.6, temperature=200.0, ess_threshold=0.5, init="independent"
  )
  s = helpers.Setup(config, dp, dd)
  for images, labels in helpers.particle_batches(p, 3):
    prev = np.asarray(jax.device_get(s.state.log_weights), np.float64)
    s.state, m = s.train_step(s.state, s.put(images, labels))
    tau, loss = float(m["temperature"]), np.asarray(m["loss"], np.float64)
    alive = np.asarray(m["alive"]) > 0
    assert 0 <= tau <= 200.0
    raw = np.where(alive, 0.9 * prev - tau * loss, -np.inf)
    expected = raw - np.logaddexp.reduce(raw[alive])
    np.testing.assert_allclose(np.asarray(m["log_weights"])[alive], expected[alive], rtol=1e-4, atol=1e-4)
    ess = float(m["ess"])
    assert ess >= 0.6 * p - 1e-3
    assert tau == 200.0 or ess < 0.6 * p + 0.05, (tau, ess)  # the largest tau: at the target, not above it


def test_jitter_scaled_by_the_learning_rate():
  config = helpers.tiny_config(jitter=0.01, jitter_lr=0.5, mode="ipf", num_particles=4)
  spec = validation.particle_spec(config)
  lr_fn = read.learning_rate_fn(config, 20, 2)
  for step in (0, 1, 10, 19):
    np.testing.assert_allclose(float(step_lib.jitter_sigma(spec, lr_fn, step)), 0.01 + 0.5 * float(lr_fn(step)))
  assert step_lib.jitter_sigma(dataclasses.replace(spec, jitter_lr=0.0), None, 3) == 0.01  # a float: static
  # a traced sigma reaches the copies: slot 1 takes particle 0 plus noise of that sigma
  spec_p, spec_r = jax.sharding.PartitionSpec("particle"), jax.sharding.PartitionSpec()
  mesh = jax.make_mesh((1,), ("particle",), devices=jax.devices()[:1])
  params = jax.device_put({"w": jnp.zeros((2, 3))}, jax.sharding.NamedSharding(mesh, spec_p))
  sigma = jax.device_put(jnp.float32(0.25), jax.sharding.NamedSharding(mesh, spec_r))
  src = jnp.asarray([0, 0])
  key = jax.random.PRNGKey(0)
  noisy = jax.jit(
    jax.shard_map(
      lambda p, s: pf.jitter(p, src, key, s, "particle"), mesh=mesh, in_specs=(spec_p, spec_r), out_specs=spec_p
    )
  )(params, sigma)
  expected = 0.25 * jax.random.normal(jax.random.fold_in(key, 1), (3,))
  np.testing.assert_array_equal(np.asarray(noisy["w"][0]), 0)
  np.testing.assert_allclose(np.asarray(noisy["w"][1]), np.asarray(expected), rtol=1e-6)


def test_seed_recipe_fields():
  assert optim.lr_scale("seed", 128, 256, devices=8, num_particles=8) == 8.0
  config = helpers.tiny_config(lr_scaling="seed", base_lr=0.1, num_particles=4, num_devices=2)
  lr_fn = read.learning_rate_fn(config, 20, 0)
  np.testing.assert_allclose(float(lr_fn(0)), 0.1 * np.sqrt(2 * 4), rtol=1e-6)
  validation.validate(helpers.tiny_config(forgetting=0.0, num_particles=8), 8)  # the seed's rule: allowed
  with pytest.raises(validation.ConfigError, match="config.ess_target: must be in"):
    validation.validate(helpers.tiny_config(ess_target=1.0, num_particles=8), 8)


@pytest.mark.parametrize("dp,dd", [(8, 1), (4, 2)])
def test_weigh_on_common_examples_against_a_plain_model(dp, dd):
  """weigh_on=common: every particle's weight comes from its loss (train mode, forward only) on the
  same examples, the first common_examples of every particle's part of each data shard."""
  import optax

  p, k = 8, 2
  config = helpers.tiny_config(
    num_particles=p, weigh_on="common", common_examples=k, init="independent", ess_threshold=0.0
  )
  s = helpers.Setup(config, dp, dd)
  images, labels = next(iter(helpers.particle_batches(p, 1)))
  host = s.host_state()
  s.state, m = s.train_step(s.state, s.put(images, labels))
  per = images.shape[1] // dd
  idx = [(i, d * per + j) for d in range(dd) for i in range(p) for j in range(k)]
  x, y = np.stack([images[i, t] for i, t in idx]), np.stack([labels[i, t] for i, t in idx])
  score = []
  for i in range(p):
    variables = {
      "params": jax.tree.map(lambda a: a[i], host.params),
      "batch_stats": jax.tree.map(lambda a: a[i], host.batch_stats),
    }
    logits, _ = s.plain_model.apply(variables, x, train=True, mutable=["batch_stats"])
    score.append(float(optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()))
  score = np.array(score)
  np.testing.assert_allclose(np.asarray(m["score"]), score, rtol=1e-4, atol=1e-5)
  raw = 0.9 * np.asarray(host.log_weights, np.float64) - config.temperature * score
  np.testing.assert_allclose(np.asarray(m["log_weights"]), raw - np.logaddexp.reduce(raw), rtol=1e-4, atol=1e-4)
  assert not np.allclose(np.asarray(m["loss"]), score)  # the training loss is each particle's own

"""The learning-rate rules, the schedule and gradient clipping against values computed by hand."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ipf_jax.config import read
from ipf_jax.spmd import optim
from tests import helpers

pytestmark = pytest.mark.core  # CI: every leg (pytest.ini)


@pytest.mark.parametrize(
  "rule,expected", [("none", 1.0), ("linear", 2.0), ("sqrt", math.sqrt(2.0)), ("seed", math.sqrt(4 * 8))]
)
def test_lr_scaling_rules(rule, expected):
  """G = 512 against reference 256 on 4 devices with P = 8: base_lr 0.1 peaks at 0.1 x scale."""
  config = helpers.tiny_config(
    lr_scaling=rule,
    global_batch_size=512,
    reference_batch_size=256,
    num_devices=4,
    num_particles=8,
    base_lr=0.1,
    warmup_steps=10,
    num_train_steps=110,
  )
  assert optim.lr_scale(rule, 512, 256, devices=4, num_particles=8) == pytest.approx(expected)
  lr = read.learning_rate_fn(config, *read.train_steps(config, 1))
  assert float(lr(10)) == pytest.approx(0.1 * expected, rel=1e-6)


def test_schedule_is_linear_warmup_then_cosine_to_zero():
  config = helpers.tiny_config(lr_scaling="none", base_lr=0.4, warmup_steps=10, num_train_steps=110)
  lr = read.learning_rate_fn(config, *read.train_steps(config, 1))
  hand = lambda k: 0.4 * k / 10 if k < 10 else 0.2 * (1 + math.cos(math.pi * (k - 10) / 100))
  for k in (0, 5, 10, 35, 60, 109, 110):
    assert float(lr(k)) == pytest.approx(hand(k), abs=1e-7), f"step {k}"


def test_the_step_reports_the_learning_rate_of_its_update_and_diversity_without_the_fused_model():
  """``metrics["lr"]`` of step k (0-based) is the schedule at k, the rate its update used (the last step's
  is above 0, the cosine reaches 0 after it); ``parts.diversity`` is ``parts.fuse``'s distances."""
  import jax

  config = helpers.tiny_config(num_particles=4, lr_scaling="none", base_lr=0.4, warmup_steps=2, num_train_steps=5)
  s = helpers.Setup(config, 2, 2)
  hand = lambda k: 0.4 * k / 2 if k < 2 else 0.2 * (1 + math.cos(math.pi * (k - 2) / 3))
  for k, (images, labels) in enumerate(helpers.particle_batches(4, 5)):
    s.state, m = s.train_step(s.state, s.put(images, labels))
    assert float(m["lr"]) == pytest.approx(hand(k), abs=1e-7), f"step {k}"
  assert float(m["lr"]) > 0
  distances = np.asarray(jax.block_until_ready(s.parts.diversity(s.state)))
  np.testing.assert_allclose(distances, np.asarray(s.parts.fuse(s.state)[1]), rtol=1e-6)
  assert distances.shape == (4,) and (distances > 0).all()


def test_epochs_set_steps_and_warmup():
  config = helpers.tiny_config(num_epochs=2.5, warmup_epochs=0.5)
  assert read.train_steps(config, 40) == (100, 20)


def test_accumulation_does_not_change_the_learning_rate():
  """grad_accum_steps splits each step's batch: the step, its batch G and its learning rate stay."""
  lrs = []
  for k in (1, 4):
    config = helpers.tiny_config(
      lr_scaling="linear",
      global_batch_size=512,
      reference_batch_size=256,
      base_lr=0.1,
      warmup_steps=10,
      num_train_steps=110,
      grad_accum_steps=k,
    )
    lr = read.learning_rate_fn(config, *read.train_steps(config, 1))
    lrs.append([float(lr(s)) for s in (5, 10, 60)])
  np.testing.assert_allclose(lrs[0], lrs[1])
  assert lrs[0][1] == pytest.approx(0.2)


@pytest.mark.parametrize("clip,norm", [(1.0, 5.0), (10.0, 5.0)])
def test_grad_clip_norm_by_hand(clip, norm):
  """Plain SGD (no momentum, no decay): the update is -lr x g x min(1, clip / |g|), |g| over all leaves."""
  config = helpers.tiny_config(grad_clip_norm=clip, momentum=0.0, weight_decay=0.0)
  tx = read.optimizer(config, lambda step: 0.5)
  grads = {"a": jnp.array([3.0, 0.0]), "b": {"kernel": jnp.array([[0.0], [4.0]])}}  # global norm 5
  params = {"a": jnp.zeros(2), "b": {"kernel": jnp.zeros((2, 1))}}
  updates, _ = tx.update(grads, tx.init(params), params)
  factor = min(1.0, clip / norm)
  np.testing.assert_allclose(updates["a"], -0.5 * factor * np.array([3.0, 0.0]), rtol=1e-6)
  np.testing.assert_allclose(updates["b"]["kernel"], -0.5 * factor * np.array([[0.0], [4.0]]), rtol=1e-6)


def test_weight_decay_on_kernels_only_and_nesterov_momentum_by_hand():
  """Two steps of SGD with Nesterov momentum mu and L2 decay wd (added before the momentum) on ndim > 1
  leaves only."""
  lr, mu, wd = 0.1, 0.9, 0.01
  config = helpers.tiny_config(momentum=mu, nesterov=True, weight_decay=wd)
  tx = read.optimizer(config, lambda step: lr)
  params = {"bias": jnp.array([1.0, -1.0]), "kernel": jnp.array([[2.0], [0.5]])}
  grads = {"bias": jnp.array([0.5, 0.25]), "kernel": jnp.array([[1.0], [-1.0]])}
  state = tx.init(params)
  hand_p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  velocity = {k: np.zeros_like(v) for k, v in hand_p.items()}
  for _ in range(2):
    updates, state = tx.update(grads, state, params)
    params = {k: params[k] + updates[k] for k in params}
    for k in hand_p:
      d = np.asarray(grads[k], np.float64) + (wd * hand_p[k] if k == "kernel" else 0.0)
      velocity[k] = mu * velocity[k] + d
      hand_p[k] = hand_p[k] - lr * (d + mu * velocity[k])
  for k in hand_p:
    np.testing.assert_allclose(params[k], hand_p[k], rtol=1e-6)


def _two_steps(config, lr, params, grads):
  tx = read.optimizer(config, lambda step: lr)
  state = tx.init(params)
  for _ in range(2):
    updates, state = tx.update(grads, state, params)
    params = {k: params[k] + updates[k] for k in params}
  return params, state


PARAMS = {"bias": jnp.array([1.0, -1.0]), "kernel": jnp.array([[2.0], [0.5]])}
GRADS = {"bias": jnp.array([0.5, 0.25]), "kernel": jnp.array([[1.0], [-1.0]])}


def test_adamw_by_hand_with_decay_on_kernels_only():
  """Two steps of AdamW: bias-corrected moments, theta -= lr (m / (sqrt(v) + eps) + wd theta), the decay on
  ndim > 1 leaves only."""
  lr, b1, b2, eps, wd = 0.1, 0.8, 0.9, 1e-3, 0.05
  config = helpers.tiny_config(optimizer="adamw", b1=b1, b2=b2, eps=eps, weight_decay=wd)
  params, _ = _two_steps(config, lr, PARAMS, GRADS)
  for k in PARAMS:
    p, g = np.asarray(PARAMS[k], np.float64), np.asarray(GRADS[k], np.float64)
    m = v = 0.0
    for t in (1, 2):
      m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
      step = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
      p = p - lr * (step + (wd * p if k == "kernel" else 0.0))
    np.testing.assert_allclose(params[k], p, rtol=1e-5)


def test_lion_by_hand_and_its_first_moment_in_bfloat16():
  """Two steps of Lion: theta -= lr (sign(b1 m + (1 - b1) g) + wd theta), then m <- b2 m + (1 - b2) g; with
  mu_dtype=bfloat16 the moment is stored in bfloat16."""
  lr, b1, b2, wd = 0.1, 0.9, 0.99, 0.05
  config = helpers.tiny_config(optimizer="lion", b1=b1, b2=b2, weight_decay=wd, mu_dtype="bfloat16")
  params, state = _two_steps(config, lr, PARAMS, GRADS)
  for k in PARAMS:
    p, g = np.asarray(PARAMS[k], np.float64), np.asarray(GRADS[k], np.float64)
    m = 0.0
    for _ in (1, 2):
      p = p - lr * (np.sign(b1 * m + (1 - b1) * g) + (wd * p if k == "kernel" else 0.0))
      m = b2 * m + (1 - b2) * g
    np.testing.assert_allclose(params[k], p, rtol=1e-5)
  moments = [x for x in jax.tree.leaves(state) if getattr(x, "ndim", 0) >= 1]
  assert moments and all(x.dtype == jnp.bfloat16 for x in moments), [x.dtype for x in moments]


def test_lamb_scales_each_leaf_by_its_trust_ratio():
  """One step of LAMB: u = m / (sqrt(v) + eps) + wd theta (kernels), theta -= lr ||theta|| / ||u|| u per leaf."""
  lr, b1, b2, eps, wd = 0.1, 0.9, 0.999, 1e-6, 0.01
  config = helpers.tiny_config(optimizer="lamb", b1=b1, b2=b2, eps=eps, weight_decay=wd)
  tx = read.optimizer(config, lambda step: lr)
  updates, _ = tx.update(GRADS, tx.init(PARAMS), PARAMS)
  for k in PARAMS:
    p, g = np.asarray(PARAMS[k], np.float64), np.asarray(GRADS[k], np.float64)
    u = g / (np.abs(g) + eps) + (wd * p if k == "kernel" else 0.0)  # first step: m / sqrt(v) = g / |g|
    np.testing.assert_allclose(updates[k], -lr * np.linalg.norm(p) / np.linalg.norm(u) * u, rtol=1e-5)


def test_the_checkpoint_names_the_optimizer_with_its_fields():
  adamw = helpers.tiny_config(optimizer="adamw", mu_dtype="bfloat16", weight_decay=0.1)
  assert read.builtin_name(adamw) == "adamw(b1=0.9, b2=0.999, eps=1e-08, mu_dtype=bfloat16, weight_decay=0.1)"
  assert read.builtin_name(helpers.tiny_config(momentum=0.9, nesterov=True, weight_decay=0.0005)) == (
    "sgd(momentum=0.9, nesterov=True, weight_decay=0.0005)"
  )

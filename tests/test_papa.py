"""Per-particle regularisation (PAPA, ``label_smoothing_spread``, ``mixup_spread``): each slot trains with its
own strength, checked against numpy's cross-entropy of the model's own logits."""

import jax
import numpy as np
import pytest

from ipf_jax.config import validation
from tests import helpers

pytestmark = pytest.mark.slow  # CI: leg 1 only (pytest.ini)


def smoothed_cross_entropy(logits, labels, smoothing, num_classes=10):
  """Mean over examples of -sum_c t_c log softmax(logits)_c, t = (1 - s) onehot + s / C (numpy, float64)."""
  z = np.asarray(logits, np.float64)
  log_p = z - z.max(-1, keepdims=True)
  log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
  t = (1 - smoothing) * np.eye(num_classes)[labels] + smoothing / num_classes
  return float(-(t * log_p).sum(-1).mean())


@pytest.mark.parametrize("dp,dd", [(4, 1), (2, 2)])
def test_each_particle_trains_with_its_own_label_smoothing(dp, dd):
  """One step: particle i's loss is the cross-entropy with smoothing 0.05 + 0.3 i / 3 of the plain model's
  logits (its own parameters) on its own batch (BatchNorm over the particle's whole batch, as SyncBN)."""
  config = helpers.tiny_config(num_particles=4, label_smoothing=0.05, label_smoothing_spread=0.3, temperature=0.0)
  s = helpers.Setup(config, dp, dd)
  ((images, labels),) = helpers.particle_batches(4, 1)
  start = s.host_state()
  _, m = s.train_step(s.state, s.put(images, labels))
  for i in range(4):
    variables = jax.tree.map(lambda x: np.asarray(x)[i], {"params": start.params, "batch_stats": start.batch_stats})
    logits, _ = s.plain_model.apply(variables, images[i], train=True, mutable=["batch_stats"])
    expected = smoothed_cross_entropy(logits, labels[i], 0.05 + 0.3 * i / 3)
    np.testing.assert_allclose(np.asarray(m["loss"])[i], expected, rtol=1e-4, err_msg=f"particle {i}")


def test_mixup_spread_leaves_slot_zero_unmixed_and_mixes_the_others():
  """mixup 0 with a spread: slot 0 does not mix (its loss is the plain cross-entropy), every other slot's is not."""
  config = helpers.tiny_config(num_particles=4, mixup_spread=0.4, weigh_on="common")
  s = helpers.Setup(config, 4, 1)
  ((images, labels),) = helpers.particle_batches(4, 1)
  start = s.host_state()
  _, m = s.train_step(s.state, s.put(images, labels))
  plain = []
  for i in range(4):
    variables = jax.tree.map(lambda x: np.asarray(x)[i], {"params": start.params, "batch_stats": start.batch_stats})
    logits, _ = s.plain_model.apply(variables, images[i], train=True, mutable=["batch_stats"])
    plain.append(smoothed_cross_entropy(logits, labels[i], 0.0))
  np.testing.assert_allclose(np.asarray(m["loss"])[0], plain[0], rtol=1e-4)
  for i in (1, 2, 3):
    assert abs(float(np.asarray(m["loss"])[i]) - plain[i]) > 1e-5, f"slot {i} must train on mixed examples"


@pytest.mark.parametrize(
  "overrides,field",
  [
    (dict(label_smoothing=0.5, label_smoothing_spread=0.5), "label_smoothing_spread"),
    (dict(mixup_spread=-0.1), "mixup_spread"),
    (dict(elastic_pull=0.1, elastic_pull_every=0), "elastic_pull_every"),
    # the per-step filter weighing each particle on its own regularised loss: the strongest always lose
    (dict(label_smoothing_spread=0.2, temperature=10.0, weigh_on="own"), "label_smoothing_spread"),
    (dict(mixup_spread=0.2, temperature=10.0, weigh_on="own"), "mixup_spread"),
    (dict(mode="ddp", num_particles=1, label_smoothing_spread=0.2), "label_smoothing_spread"),
  ],
)
def test_per_particle_config_errors_name_the_field(overrides, field):
  with pytest.raises(validation.ConfigError) as e:
    validation.validate(helpers.tiny_config(**{"num_particles": 4, **overrides}), 8)
  assert e.value.field == field

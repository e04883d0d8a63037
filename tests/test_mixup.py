"""mixup and soft targets (issue: ViTs, optimizers, fine-tuning, item 3): the loss against numpy, the step
against the plain-loop reference (which mixes each particle's batch in numpy) on meshes where a particle's
batch is split over 4 and over 2 data shards (with gradient accumulation): a roll that stayed on one shard
fails both."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ipf_jax.config import validation
from ipf_jax.config.validation import ConfigError
from ipf_jax.spmd.task import classification
from tests import helpers
from tests.test_step import assert_same_run, run_both

pytestmark = pytest.mark.slow  # CI: leg 1 only (pytest.ini)


def _numpy_cross_entropy(logits, targets):
  logits = np.asarray(logits, np.float64)
  log_p = logits - logits.max(-1, keepdims=True)
  log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
  return -(targets * log_p).sum(-1)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_soft_targets_loss_is_cross_entropy_against_numpy(smoothing):
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(6, 5)).astype(np.float32)
  soft = rng.dirichlet(np.ones(5), size=6).astype(np.float32)
  labels = rng.integers(0, 5, size=6)
  task = classification(None, label_smoothing=smoothing)
  smooth = lambda t: t * (1 - smoothing) + smoothing / 5
  np.testing.assert_allclose(
    task.loss(jnp.asarray(logits), {"label": jnp.asarray(soft)}), _numpy_cross_entropy(logits, smooth(soft)), rtol=1e-5
  )
  np.testing.assert_allclose(
    task.loss(jnp.asarray(logits), {"label": jnp.asarray(labels)}),
    _numpy_cross_entropy(logits, smooth(np.eye(5)[labels])),
    rtol=1e-5,
  )


@pytest.mark.parametrize("dp,dd,p,k", [(2, 4, 4, 1), (4, 2, 8, 2)])
def test_mixup_step_matches_reference(dp, dd, p, k):
  """The particle's batch mixed with one ratio per particle and step, each example with the one before it
  across the particle's data shards (with gradient accumulation: within each micro-batch), as the
  reference does on the whole batch in numpy; resampling on most steps."""
  config = helpers.tiny_config(
    num_particles=p, temperature=4.0, correction=0.5, ess_threshold=0.9, mixup=0.4, grad_accum_steps=k
  )
  s, ref, spmd, refr = run_both(config, dp, dd, num_steps=3)
  assert sum(r["resampled"] for r in refr) >= 1, "the test must exercise resampling"
  assert_same_run(s, ref, spmd, refr)
  assert s.task.augment is not None and ref.mixup == 0.4  # both sides mixed (a fail above, if the roll breaks)


def test_mixup_fields_are_checked():
  config = helpers.tiny_config(mixup=-0.1)
  with pytest.raises(ConfigError, match="mixup"):
    validation.validate(config, jax.device_count())
  with pytest.raises(ValueError, match="num_classes"):
    classification(None, mixup=0.2)

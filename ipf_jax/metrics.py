"""Classification metrics as additive sums (accuracy, NLL, ECE), so eval
batches and devices combine with ``+``/``psum`` and finish on the host."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

NUM_ECE_BINS = 15
_EPS = 1e-12


def classification_sums(probs, labels, mask, num_bins: int = NUM_ECE_BINS):
  """Sums over the batch of one model's (or ensemble's) predictions.

  Args:
    probs: ``[b, C]`` predictive probabilities.
    labels: ``[b]`` int labels.
    mask: ``[b]`` 1 for a real example, 0 for padding.
  Returns:
    dict with ``count``, ``correct``, ``nll`` (scalars) and ``ece_bins``
    ``[num_bins, 3]`` = per confidence bin (count, sum of confidence, correct).
  """
  mask = mask.astype(jnp.float32)
  conf = jnp.max(probs, axis=-1)
  correct = (jnp.argmax(probs, axis=-1) == labels).astype(jnp.float32)
  p_true = jnp.take_along_axis(probs, labels[:, None], axis=-1)[:, 0]
  nll = -jnp.log(jnp.maximum(p_true, _EPS))
  bins = jax.nn.one_hot(jnp.clip((conf * num_bins).astype(jnp.int32), 0, num_bins - 1), num_bins)
  bins = bins * mask[:, None]
  ece_bins = jnp.stack([bins.sum(0), bins.T @ conf, bins.T @ correct], axis=-1)
  return {"count": mask.sum(), "correct": (correct * mask).sum(), "nll": (nll * mask).sum(),
          "ece_bins": ece_bins}


def finalize(sums) -> dict:
  """accuracy, nll and ECE (expected calibration error, equal-width bins) from sums."""
  sums = jax.tree.map(np.asarray, sums)
  count = sums["count"]
  bins = sums["ece_bins"]
  n_b = bins[..., 0]
  gap = np.abs(bins[..., 2] - bins[..., 1])  # |sum correct - sum conf| = n_b |acc_b - conf_b|
  return {"accuracy": sums["correct"] / count, "nll": sums["nll"] / count,
          "ece": gap.sum(-1) / np.maximum(n_b.sum(-1), 1)}


def weighted_train_loss(m: dict) -> float:
  """``sum_i w_i loss_i`` over the finite particles of one train step's host metrics."""
  w = np.exp(m["log_weights"])
  return float(np.sum(np.where(m["alive"] > 0, w * np.nan_to_num(m["loss"]), 0.0)))

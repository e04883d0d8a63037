"""Metrics as additive sums (classification: accuracy, NLL, ECE; Gaussian regression: NLL, RMSE), so
eval batches and devices combine with ``+``/``psum`` and finish on the host."""
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


def gaussian_nll(y, mean, sigma):
  """``-log N(y | mean, sigma^2)`` per example."""
  return 0.5 * jnp.log(2 * jnp.pi) + jnp.log(sigma) + 0.5 * jnp.square((y - mean) / sigma)


def regression_sums(pred, targets, mask):
  """Sums over the batch of one model's (or one mixture's) Gaussian predictions.

  Args:
    pred: ``{"log_density": [b], "mean": [b], "second_moment": [b]}``: the log-density of the target
      and the predictive mean and second moment (a mixture averages the density and the moments).
    targets: ``[b]``.
    mask: ``[b]`` 1 for a real example, 0 for padding.
  Returns:
    ``count``, ``nll`` (``-log density``), ``squared_error`` of the mean, ``variance`` of the prediction.
  """
  mask = mask.astype(jnp.float32)
  nll = -pred["log_density"]
  variance = jnp.maximum(pred["second_moment"] - jnp.square(pred["mean"]), 0.0)
  return {"count": mask.sum(), "nll": (nll * mask).sum(),
          "squared_error": (jnp.square(targets - pred["mean"]) * mask).sum(), "variance": (variance * mask).sum()}


def finalize_regression(sums) -> dict:
  """NLL, RMSE of the predictive mean, and the mean predictive variance."""
  sums = jax.tree.map(np.asarray, sums)
  count = sums["count"]
  return {"nll": sums["nll"] / count, "rmse": np.sqrt(sums["squared_error"] / count),
          "mean_variance": sums["variance"] / count}

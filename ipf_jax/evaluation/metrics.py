"""Metrics as additive sums (classification: accuracy, NLL, ECE; Gaussian regression: NLL, RMSE), so
eval batches and devices combine with ``+``/``psum`` and finish on the host."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

NUM_ECE_BINS = 15
NUM_CERTAINTY_BINS = 200  # selective prediction and OOD AUROC: histograms of certainty (see ``certainty``)
CERTAINTY_DECADES = 7.0  # certainty bins resolve 1 - max prob (and the entropy) down to 1e-7
TEMPERATURES = 2.0 ** np.arange(-2.0, 3.0 + 1e-9, 0.125)  # temperature scaling grid, 0.25 .. 8 (1 included)
COVERAGES = np.arange(1, 101) / 100.0  # selective prediction: accuracy at these fractions of the examples kept
_EPS = 1e-12


def certainty(probs):
  """Two certainty scores in ``[0, 1]``, higher = more certain, for each example: from the maximum
  probability, ``-log10(1 - max p) / 7``, and from the predictive entropy ``H``,
  ``(log10 log C - log10 H) / (7 + log10 log C)`` (both clipped; 7 decades resolve float32's
  confidences near 1). ``[..., b, 2]``."""
  num_classes = probs.shape[-1]
  from_max = -jnp.log10(jnp.maximum(1.0 - jnp.max(probs, axis=-1), 10.0**-CERTAINTY_DECADES)) / CERTAINTY_DECADES
  entropy = -jnp.sum(probs * jnp.log(jnp.maximum(probs, _EPS)), axis=-1)
  top = np.log10(np.log(max(num_classes, 2)))
  from_entropy = (top - jnp.log10(jnp.maximum(entropy, 10.0**-CERTAINTY_DECADES))) / (CERTAINTY_DECADES + top)
  return jnp.clip(jnp.stack([from_max, from_entropy], axis=-1), 0.0, 1.0)


def _bins(values, num_bins):
  """One-hot equal-width bins of ``values`` in ``[0, 1]``."""
  return jax.nn.one_hot(jnp.clip((values * num_bins).astype(jnp.int32), 0, num_bins - 1), num_bins)


def _calibration_sums(probs, labels, mask, num_bins):
  """NLL, Brier and the reliability bins of ``probs`` ``[b, C]`` (a label outside ``[0, C)`` is never
  correct and has probability 0)."""
  onehot = jax.nn.one_hot(labels, probs.shape[-1])
  conf = jnp.max(probs, axis=-1)
  correct = (jnp.argmax(probs, axis=-1) == labels).astype(jnp.float32)
  p_true = jnp.sum(probs * onehot, axis=-1)
  nll = -jnp.log(jnp.maximum(p_true, _EPS))
  brier = jnp.sum(jnp.square(probs - onehot), axis=-1)
  bins = _bins(conf, num_bins) * mask[:, None]
  ece_bins = jnp.stack([bins.sum(0), bins.T @ conf, bins.T @ correct], axis=-1)
  return {"nll": jnp.sum(nll * mask), "brier": jnp.sum(brier * mask), "ece_bins": ece_bins}, correct


def classification_sums(probs, labels, mask, num_bins: int = NUM_ECE_BINS):
  """Sums over the batch of one model's (or ensemble's) predictions.

  Args:
    probs: ``[b, C]`` predictive probabilities.
    labels: ``[b]`` int labels.
    mask: ``[b]`` 1 for a real example, 0 for padding.
  Returns:
    dict with ``count``, ``correct``, ``nll``, ``brier`` (scalars); ``ece_bins`` ``[num_bins, 3]`` = per
    confidence bin (count, sum of confidence, correct); ``certainty_bins`` ``[2, NUM_CERTAINTY_BINS, 2]``
    = per ``certainty`` score and bin (count, correct); and, for temperature scaling,
    ``tempered`` = the same ``nll``, ``brier`` and ``ece_bins`` for ``probs ** (1 / T)`` renormalised, for
    each ``T`` of ``TEMPERATURES`` (a leading axis).
  """
  mask = mask.astype(jnp.float32)
  sums, correct = _calibration_sums(probs, labels, mask, num_bins)
  scores = _bins(certainty(probs), NUM_CERTAINTY_BINS) * mask[:, None, None]  # [b, 2, K]
  certainty_bins = jnp.stack([scores.sum(0), jnp.einsum("bsk,b->sk", scores, correct)], axis=-1)
  log_p = jnp.log(jnp.maximum(probs, 1e-30))
  # one temperature at a time (lax.map): a [b, C] buffer, not [T, b, C] (ImageNet: 41 x 1000 x 1000 floats)
  tempered_sums = lax.map(
    lambda t: _calibration_sums(jax.nn.softmax(log_p / t, axis=-1), labels, mask, num_bins)[0],
    jnp.asarray(TEMPERATURES, jnp.float32),
  )
  return {
    "count": mask.sum(),
    "correct": (correct * mask).sum(),
    **sums,
    "certainty_bins": certainty_bins,
    "tempered": tempered_sums,
  }


def _ece(bins):
  n_b = bins[..., 0]
  gap = np.abs(bins[..., 2] - bins[..., 1])  # |sum correct - sum conf| = n_b |acc_b - conf_b|
  return gap.sum(-1) / np.maximum(n_b.sum(-1), 1)


def selective(certainty_bins):
  """Accuracy when only the most certain fraction ``c`` of the examples is kept, at ``COVERAGES``, and
  the area under that curve, from ``certainty_bins[..., K, 2]`` (count, correct) of one score. Examples
  of one bin count as tied: within a bin, kept and correct examples grow in proportion."""
  counts, correct = certainty_bins[..., ::-1, 0], certainty_bins[..., ::-1, 1]  # most certain first
  zero = np.zeros(counts.shape[:-1] + (1,))
  kept, right = np.concatenate([zero, np.cumsum(counts, -1)], -1), np.concatenate([zero, np.cumsum(correct, -1)], -1)
  total = kept[..., -1:]
  target = COVERAGES * total  # [..., len(COVERAGES)]
  interp = np.vectorize(np.interp, signature="(n),(k),(k)->(n)")
  right_at = interp(target, kept, right)
  accuracy = right_at / np.maximum(target, _EPS)
  return accuracy, accuracy.mean(-1)


def auroc(in_bins, out_bins):
  """Area under the ROC curve of telling in-distribution from out-of-distribution examples by a
  certainty score: P(an in-distribution example is more certain than an OOD one), ties (one bin)
  counted half. ``in_bins``/``out_bins``: ``[..., K]`` counts per certainty bin."""
  below = np.cumsum(out_bins, -1) - out_bins  # OOD examples in lower bins
  pairs = np.sum(in_bins * (below + 0.5 * out_bins), -1)
  return pairs / np.maximum(in_bins.sum(-1) * out_bins.sum(-1), _EPS)


def finalize(sums) -> dict:
  """accuracy, NLL, ECE (equal-width bins), Brier score; ``reliability`` ``[bins, 3]`` (count, mean
  confidence, accuracy per bin); selective prediction by the maximum probability
  (``selective_accuracy`` at ``COVERAGES``, ``selective_auc``); the certainty histograms (for OOD
  AUROC); and the NLL, ECE and Brier of each tempered prediction (``*_by_temperature``)."""
  sums = jax.tree.map(np.asarray, sums)
  count = sums["count"]
  bins = sums["ece_bins"]
  n_b = np.maximum(bins[..., 0], 1)
  accuracy_at, area = selective(sums["certainty_bins"][..., 0, :, :])
  tempered = sums["tempered"]
  per_t = lambda x: x / count[..., None]
  return {
    "accuracy": sums["correct"] / count,
    "nll": sums["nll"] / count,
    "ece": _ece(bins),
    "brier": sums["brier"] / count,
    "selective_auc": area,
    "selective_accuracy": accuracy_at,
    "reliability": np.stack([bins[..., 0], bins[..., 1] / n_b, bins[..., 2] / n_b], -1),
    "certainty_counts": sums["certainty_bins"][..., 0],
    "nll_by_temperature": per_t(tempered["nll"]),
    "brier_by_temperature": per_t(tempered["brier"]),
    "ece_by_temperature": _ece(tempered["ece_bins"]),
  }


def diversity_sums(probs, alive, mask, total):
  """Sums over the batch of the population's diversity: ``disagreement`` (the fraction of ordered
  pairs of live particles whose predicted classes differ) and ``pairwise_kl`` (mean ``KL(p_i || p_j)``
  over ordered pairs ``i != j``), both computed from sums over particles, without gathering them.

  Args:
    probs: ``[L, b, C]`` this device's particles' probabilities.
    alive: ``[L]`` 1 for a particle with a finite weight.
    mask: ``[b]``.
    total: sums an array over all particles (``psum`` over the particle axis).
  """
  mask = mask.astype(jnp.float32)
  a = alive.astype(jnp.float32)[:, None, None]
  n = total(jnp.sum(alive.astype(jnp.float32)))
  votes = total(jnp.sum(a * jax.nn.one_hot(jnp.argmax(probs, -1), probs.shape[-1]), 0))  # [b, C]
  log_p = jnp.log(jnp.maximum(jnp.where(a > 0, probs, 1.0), _EPS))
  self_term = total(jnp.sum(a[..., 0] * jnp.sum(jnp.where(a > 0, probs, 0.0) * log_p, -1), 0))  # [b]
  cross = jnp.sum(total(jnp.sum(jnp.where(a > 0, probs, 0.0), 0)) * total(jnp.sum(a * log_p, 0)), -1)
  pairs = jnp.maximum(n * (n - 1), 1.0)
  disagree = jnp.where(n > 1, 1.0 - jnp.sum(votes * (votes - 1), -1) / pairs, 0.0)
  kl = jnp.where(n > 1, (n * self_term - cross) / pairs, 0.0)
  return {"count": mask.sum(), "disagreement": (disagree * mask).sum(), "pairwise_kl": (kl * mask).sum()}


def finalize_diversity(sums) -> dict:
  sums = jax.tree.map(np.asarray, sums)
  # both are >= 0; float32 sums of many terms can land a hair below
  return {
    "disagreement": np.maximum(sums["disagreement"] / sums["count"], 0.0),
    "pairwise_kl": np.maximum(sums["pairwise_kl"] / sums["count"], 0.0),
  }


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
  return {
    "count": mask.sum(),
    "nll": (nll * mask).sum(),
    "squared_error": (jnp.square(targets - pred["mean"]) * mask).sum(),
    "variance": (variance * mask).sum(),
  }


def finalize_regression(sums) -> dict:
  """NLL, RMSE of the predictive mean, and the mean predictive variance."""
  sums = jax.tree.map(np.asarray, sums)
  count = sums["count"]
  return {
    "nll": sums["nll"] / count,
    "rmse": np.sqrt(sums["squared_error"] / count),
    "mean_variance": sums["variance"] / count,
  }

"""An evaluation's results beyond the eval step's sums: the rows of the final table, a shifted set's brief
results, temperature scaling fitted on a held-out set, OOD AUROC (numpy, on the host)."""

from __future__ import annotations

from typing import Optional

import numpy as np

from ipf_jax.evaluation import metrics

ROWS = (
  ("ensemble (weighted)", "ensemble"),
  ("ensemble (uniform)", "ensemble_uniform"),
  ("fused model", "fused"),
  ("fused model, BN re-estimated", "fused_bn"),
)


BRIEF = ("accuracy", "nll", "ece", "brier", "selective_auc", "reliability")  # what a shifted set keeps


def brief(results: dict, calibration: Optional[dict] = None) -> dict:
  """Each row's (and each particle's) scalar metrics and reliability bins, without the histograms and
  temperature curves (a shifted set's results). With ``calibration`` (the held-out set's results), also
  ``temperature_scaled``: each row's NLL, ECE and Brier at the temperature fitted on it, as the test set's."""
  keep = lambda m, scalar: {k: v for k, v in m.items() if k in BRIEF or (k not in _CURVES and np.ndim(v) == scalar)}
  out = {k: keep(v, 1 if k == "particles" else 0) if isinstance(v, dict) else v for k, v in results.items()}
  scaled = temperature_scaled(calibration, results) if calibration is not None else {}
  if scaled:  # a task without tempered metrics (regression) has none
    out["temperature_scaled"] = scaled
  return out


_CURVES = ("selective_accuracy", "certainty_counts", "nll_by_temperature", "brier_by_temperature", "ece_by_temperature")


def temperature_scaled(calibration: dict, test: dict) -> dict:
  """For each row: the temperature ``T`` of ``metrics.TEMPERATURES`` with the lowest NLL on the
  calibration set, and the test set's NLL, ECE and Brier of the prediction tempered by it
  (``p ** (1 / T)`` renormalised; accuracy does not change). Rows without tempered metrics (tasks other
  than classification) are left out."""
  out = {}
  for _, key in ROWS:
    curve = np.asarray(calibration.get(key, {}).get("nll_by_temperature", np.nan))
    if np.isfinite(curve).any():
      i = int(np.nanargmin(curve))
      out[key] = {
        "temperature": float(metrics.TEMPERATURES[i]),
        "at_grid_edge": i in (0, len(curve) - 1),
        **{m: float(test[key][f"{m}_by_temperature"][i]) for m in ("nll", "ece", "brier")},
      }
  return out


def ood_auroc(test: dict, ood: dict) -> dict:
  """OOD AUROC of each row and particle, by the maximum probability and by the predictive entropy
  (``metrics.certainty``): test examples as positives, the OOD set's as negatives."""
  out = {}
  for key in ("particles",) + tuple(k for _, k in ROWS):
    if "certainty_counts" in test.get(key, {}):
      a, b = np.asarray(test[key]["certainty_counts"]), np.asarray(ood[key]["certainty_counts"])
      out[key] = {
        "auroc_max_prob": metrics.auroc(a[..., 0, :], b[..., 0, :]),
        "auroc_entropy": metrics.auroc(a[..., 1, :], b[..., 1, :]),
      }
  return out

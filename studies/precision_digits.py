"""Compute dtypes on real data: float32, bfloat16, float16 with and without dynamic loss scaling.

  python -m studies.precision_digits [--seeds 3] [--steps 300] [--variants "float32;float16, scale 1"]

Digits (scikit-learn), 8 fake CPU devices, the digits config (ipf, 8
particles, global batch 128) for every row; only ``dtype`` and the loss scale
change. "float16, scale 1" keeps the scale at 1 for the whole run (growth
interval longer than the run): plain float16 gradients, the ablation of loss
scaling. Reports mean ± std over seeds of the fused model's and the weighted
ensemble's test accuracy and NLL, the steps skipped for overflow and the final
loss scale. Prints a markdown table and ``SUMMARY {json}``. The CPU emulates
float16/bfloat16, so this says nothing about speed: see ``gpu_resnet50.py
--dtype``. A benchmark, not a test.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from benchmarks.common import base_overrides, digits_study, study_parser  # noqa: E402

VARIANTS = {
  "float32": dict(dtype="float32"),
  "bfloat16": dict(dtype="bfloat16"),
  "float16, dynamic loss scale (default)": dict(dtype="float16"),
  "float16, scale 1": dict(dtype="float16", loss_scale_init=1.0, loss_scale_growth_interval=10**9),
}


def row(results, scalars):
  out = {
    "fused_acc": results["fused"]["accuracy"],
    "ens_acc": results["ensemble"]["accuracy"],
    "fused_nll": results["fused"]["nll"],
    "ens_nll": results["ensemble"]["nll"],
    "final_train_loss": float(scalars["train/loss"][1][-1]),
  }
  if "train/overflow" in scalars:
    out["overflow_steps"] = float(scalars["train/overflow"][1].sum())
    out["final_loss_scale"] = float(scalars["train/loss_scale"][1][-1])
  return out


def main():
  parser = study_parser(__doc__)
  parser.add_argument("--variants", default=";".join(VARIANTS), help="a ';' list (the names hold commas)")
  args = parser.parse_args()
  names = args.variants.split(";")
  unknown = [n for n in names if n not in VARIANTS]
  if unknown:
    parser.error(f"--variants: unknown {unknown}; the variants are {list(VARIANTS)}")
  digits_study(
    "precision_digits",
    {n: VARIANTS[n] for n in names},
    row,
    args.seeds,
    args.steps,
    [
      ("fused_acc", 100, ".2f"),
      ("ens_acc", 100, ".2f"),
      ("fused_nll", 1, ".4f"),
      ("ens_nll", 1, ".4f"),
      ("final_train_loss", 1, ".4f"),
      ("overflow_steps", 1, ".1f"),
      ("final_loss_scale", 1, ".0f"),
    ],
    base=base_overrides(args),
  )


if __name__ == "__main__":
  main()

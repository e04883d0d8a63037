"""The fused model with re-estimated BatchNorm statistics vs the weighted average of the particles'.

  python -m studies.fused_bn_digits [--seeds 3] [--steps 300] [--batches 8]

Digits (scikit-learn), 8 fake CPU devices, the digits config (8 particles,
global batch 128, shared init) in settings where the particles end up more or
less far apart: ipf with the default correction (lambda 0.5), ipf without
correction (lambda 0), and independent particles from one init (ensemble
weights and no resampling, ``init=shared``). Each run evaluates both fused
models on the same parameters: ``sum_i w_i beta_i`` statistics and statistics
re-estimated on ``--batches`` training batches (``fused_bn_batches``). Reports
mean ± std over seeds of test accuracy and NLL and the mean particle distance
to the fused parameters. Prints a markdown table and ``SUMMARY {json}``. A
benchmark, not a test.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from benchmarks.common import base_overrides, digits_study, study_parser  # noqa: E402

SETTINGS = {
  "ipf, lambda 0.5 (default)": dict(),
  "ipf, lambda 0": dict(correction=0.0),
  "independent from one init": dict(mode="ensemble", init="shared"),
}


def main():
  parser = study_parser(__doc__)
  parser.add_argument("--batches", type=int, default=8)
  args = parser.parse_args()

  def row(results, scalars):
    return {
      "fused_acc": results["fused"]["accuracy"],
      "fused_bn_acc": results["fused_bn"]["accuracy"],
      "fused_nll": results["fused"]["nll"],
      "fused_bn_nll": results["fused_bn"]["nll"],
      "diversity": float(scalars["train/diversity"][1][-1]),
    }

  variants = {k: {**v, "fused_bn_batches": args.batches} for k, v in SETTINGS.items()}
  digits_study(
    "fused_bn_digits",
    variants,
    row,
    args.seeds,
    args.steps,
    [
      ("fused_acc", 100, ".2f"),
      ("fused_bn_acc", 100, ".2f"),
      ("fused_nll", 1, ".4f"),
      ("fused_bn_nll", 1, ".4f"),
      ("diversity", 1, ".3f"),
    ],
    note=f"BN re-estimated on {args.batches} training batches of 128",
    base=base_overrides(args),
  )


if __name__ == "__main__":
  main()

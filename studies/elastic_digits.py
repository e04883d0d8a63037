"""The elastic pull (DESIGN.md §3.4): theta_i <- theta_i + alpha (theta_bar - theta_i) after each update.

  python -m studies.elastic_digits [--seeds 3] [--steps 300]

Digits (scikit-learn), 8 fake CPU devices, the digits config (ipf, 8
particles, global batch 128, tau 10, lambda 0.5) with alpha in {0, 0.05, 0.2},
on the full training split and on the harder variant (20% of it with 20%
label noise). Reports mean ± std over seeds of the fused model's and the
weighted ensemble's test accuracy and NLL, and the mean particle distance to
the fused parameters at the end. Prints a markdown table and ``SUMMARY
{json}``. A benchmark, not a test.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from benchmarks.common import base_overrides, digits_study, study_parser  # noqa: E402

DATA = {"full": dict(), "20% subset + 20% noise": dict(train_fraction=0.2, label_noise=0.2)}
ALPHAS = (0.0, 0.05, 0.2)


def row(results, scalars):
  return {
    "fused_acc": results["fused"]["accuracy"],
    "ens_acc": results["ensemble"]["accuracy"],
    "fused_nll": results["fused"]["nll"],
    "ens_nll": results["ensemble"]["nll"],
    "diversity": float(scalars["train/diversity"][1][-1]),
  }


def main():
  parser = study_parser(__doc__)
  args = parser.parse_args()
  variants = {
    f"{data}, alpha {alpha}": {**overrides, "elastic_pull": alpha}
    for data, overrides in DATA.items()
    for alpha in ALPHAS
  }
  digits_study(
    "elastic_digits",
    variants,
    row,
    args.seeds,
    args.steps,
    [
      ("fused_acc", 100, ".2f"),
      ("ens_acc", 100, ".2f"),
      ("fused_nll", 1, ".4f"),
      ("ens_nll", 1, ".4f"),
      ("diversity", 1, ".3f"),
    ],
    base=base_overrides(args),
  )


if __name__ == "__main__":
  main()

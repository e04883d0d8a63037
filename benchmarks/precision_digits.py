"""Compute dtypes on real data: float32, bfloat16, float16 with and without dynamic loss scaling.

  python -m benchmarks.precision_digits [--seeds 3] [--steps 300]

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

import argparse
import logging
import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np  # noqa: E402

from benchmarks.common import print_summary  # noqa: E402
from configs import digits  # noqa: E402
from ipf_jax import report, trainer  # noqa: E402

VARIANTS = {
    "float32": dict(dtype="float32"),
    "bfloat16": dict(dtype="bfloat16"),
    "float16, dynamic loss scale (default)": dict(dtype="float16"),
    "float16, scale 1": dict(dtype="float16", loss_scale_init=1.0, loss_scale_growth_interval=10 ** 9),
}


def run_one(variant, seed, steps, workdir):
  config = digits.get_config()
  config.seed = seed
  config.num_train_steps = steps
  config.log_every_steps = steps
  config.checkpoint_every_steps = -1
  config.num_cpu_devices = 0
  for k, v in VARIANTS[variant].items():
    config[k] = v
  results = trainer.train_and_evaluate(config, workdir)
  scalars = report.read_scalars(workdir)
  row = {"fused_acc": results["fused"]["accuracy"], "ens_acc": results["ensemble"]["accuracy"],
         "fused_nll": results["fused"]["nll"], "ens_nll": results["ensemble"]["nll"],
         "final_train_loss": float(scalars["train/loss"][1][-1])}
  if "train/overflow" in scalars:
    row["overflow_steps"] = float(scalars["train/overflow"][1].sum())
    row["final_loss_scale"] = float(scalars["train/loss_scale"][1][-1])
  return row


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=300)
  args = parser.parse_args()
  logging.getLogger("ipf_jax").disabled = True
  table = {}
  with tempfile.TemporaryDirectory() as tmp:
    for variant in VARIANTS:
      runs = [run_one(variant, seed, args.steps, os.path.join(tmp, f"{variant}-{seed}")) for seed in range(args.seeds)]
      table[variant] = {k: (float(np.mean([r[k] for r in runs])), float(np.std([r[k] for r in runs])))
                        for k in runs[0]}
      print(f"done {variant}", flush=True)
  cols = [("fused_acc", 100, ".2f"), ("ens_acc", 100, ".2f"), ("fused_nll", 1, ".4f"), ("ens_nll", 1, ".4f"),
          ("final_train_loss", 1, ".4f"), ("overflow_steps", 1, ".1f"), ("final_loss_scale", 1, ".0f")]
  print(f"\n{args.seeds} seeds, {args.steps} steps, digits config (ipf, 8 particles, batch 128), mean ± std\n")
  print("| dtype | " + " | ".join(c for c, _, _ in cols) + " |")
  print("|" + "---|" * (len(cols) + 1))
  for variant, row in table.items():
    cells = [f"{s * row[c][0]:{f}} ± {s * row[c][1]:{f}}" if c in row else "–" for c, s, f in cols]
    print(f"| {variant} | " + " | ".join(cells) + " |")
  print_summary({"benchmark": "precision_digits", "seeds": args.seeds, "steps": args.steps,
                 "results": {v: {k: r[k][0] for k in r} for v, r in table.items()}})


if __name__ == "__main__":
  main()

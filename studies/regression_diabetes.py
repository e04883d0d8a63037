"""The regression example (examples/regression_diabetes.py) for each mode and several seeds.

  python -m studies.regression_diabetes [--seeds 3] [--steps 150]

scikit-learn's diabetes data, a fixed 25% test split, standardised target
(NLL and RMSE in units of its standard deviation; RMSE 1.0 = predicting the
mean). 8 particles (DDP: 1), global batch 64, same steps for every mode.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile

import numpy as np

from benchmarks.common import print_summary

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import regression_diabetes  # noqa: E402

import ipf_jax  # noqa: E402


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=150)
  args = parser.parse_args()
  logging.getLogger("ipf_jax").disabled = True
  data, y_scale = regression_diabetes.load()
  rows = {}
  with tempfile.TemporaryDirectory() as tmp:
    for mode, particles in (("ddp", 1), ("ensemble", 8), ("ipf", 8)):
      runs = []
      for seed in range(args.seeds):
        config = regression_diabetes.config_for(mode, particles, args.steps, seed)
        config.global_batch_size = 64
        results = ipf_jax.train_and_evaluate(
          config,
          os.path.join(tmp, f"{mode}-{seed}"),
          task=ipf_jax.gaussian_regression(regression_diabetes.GaussianMLP()),
          data=data,
        )
        runs.append({f"{row}_{m}": float(results[row][m]) for row in ("ensemble", "fused") for m in ("nll", "rmse")})
      rows[mode] = {k: (float(np.mean([r[k] for r in runs])), float(np.std([r[k] for r in runs]))) for k in runs[0]}
      print(f"done {mode}", flush=True)
  print(
    f"\n{args.seeds} seeds, {args.steps} steps, batch 64; standardised target (RMSE x {y_scale:.1f} = target units)\n"
  )
  print("| mode | ensemble NLL | ensemble RMSE | fused NLL | fused RMSE |")
  print("|---|---|---|---|---|")
  for mode, r in rows.items():
    cells = [f"{r[k][0]:.3f} ± {r[k][1]:.3f}" for k in ("ensemble_nll", "ensemble_rmse", "fused_nll", "fused_rmse")]
    print(f"| {mode} | " + " | ".join(cells) + " |")
  print_summary(
    {
      "benchmark": "regression_diabetes",
      "seeds": args.seeds,
      "steps": args.steps,
      "results": {m: {k: v[0] for k, v in r.items()} for m, r in rows.items()},
    }
  )


if __name__ == "__main__":
  main()

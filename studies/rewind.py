"""Rewind on divergence (config.rewind) on digits: a fault injected once (every parameter scaled x30 at step 33
of 80: the loss jumps and stays up), with and without rewind, against the same run without the fault. The
fault and the configuration are tests/test_rewind.py's.

  python -m studies.rewind --seeds 3      # about 3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import tempfile

import numpy as np

from ipf_jax.runtime import trainer
from tests.test_rewind import config, fault_once


def final_loss(workdir: str) -> float:
  """The last progress line's training loss, from the run's train.log."""
  lines = [line for line in open(f"{workdir}/train.log") if " step 80/80 " in line]
  return float(lines[-1].split("loss ")[1].split()[0])


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--seeds", type=int, default=3)
  args = parser.parse_args()
  arms = {"no fault": (False, False), "fault, rewind off": (True, False), "fault, rewind on": (True, True)}
  rows = {name: [] for name in arms}
  for seed in range(args.seeds):
    for name, (fault, on) in arms.items():
      workdir = tempfile.mkdtemp()
      hook = fault_once([]) if fault else None
      r = trainer.train_and_evaluate(config(seed=seed, rewind=on), workdir, step_hook=hook)
      rows[name].append((r["fused"]["accuracy"], r["fused"]["nll"], final_loss(workdir)))
  print(f"digits, mode=ddp, 80 steps, {args.seeds} seeds (mean ± std)")
  print("| run | accuracy | NLL | final training loss |\n|---|---|---|---|")
  for name, values in rows.items():
    acc, nll, loss = np.asarray(values).T
    print(
      f"| {name} | {100 * acc.mean():.2f} ± {100 * acc.std():.2f}% | {nll.mean():.3f} ± {nll.std():.3f} | "
      f"{loss.mean():.3g} ± {loss.std():.2g} |"
    )


if __name__ == "__main__":
  main()

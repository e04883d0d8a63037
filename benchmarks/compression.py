"""Bytes moved by the correction, exact fp32 psum vs int8 compressed, and what compression costs in accuracy.

  python -m benchmarks.compression [--seeds 3] [--model cnn]

1. Compiles the ipf train step three times (lambda = 0, lambda = 0.5 exact,
   lambda = 0.5 compressed) on 8 CPU devices, reads every collective in the
   compiled HLO and counts the bytes each device sends: all-reduce
   2(n-1)/n x size (ring), all-to-all and all-gather (n-1)/n x result size,
   n = replica group size. The correction's bytes are each step's total minus
   the lambda = 0 step's total (same metrics and BatchNorm traffic), all three
   compiled without the resampling branch (whose exchange, run only on
   resampling steps, moves whole particles including their residuals).
2. Trains digits (300 steps) with and without compression for each seed and
   reports fused/ensemble test accuracy.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import Bench, print_summary, print_table  # noqa: E402
from configs import digits  # noqa: E402
from ipf_jax.runtime import trainer  # noqa: E402

DTYPE_BYTES = {
  "f32": 4,
  "s32": 4,
  "u32": 4,
  "bf16": 2,
  "f16": 2,
  "s8": 1,
  "u8": 1,
  "pred": 1,
  "f64": 8,
  "s64": 8,
  "u64": 8,
}
COLLECTIVE = re.compile(
  r"=\s*(.*?)\s(all-reduce|all-to-all|all-gather|collective-permute|reduce-scatter)"
  r"(?:-start)?\("
)
SHAPE = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\]")


def group_size(line: str) -> int:
  """The devices in each group of an HLO collective: listed ids (``replica_groups={{0,1},{2,3}}``, jax 0.10's
  XLA) or mesh axes (``replica_groups=mesh['particle'=4,'data'=2] {'data'}``, jax 0.12's); else every device."""
  listed = re.search(r"replica_groups=\{\{([\d,]+)\}", line)
  if listed:
    return len(listed.group(1).split(","))
  over = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
  if over:
    sizes = dict((k, int(v)) for k, v in re.findall(r"'([^']*)'=(\d+)", over.group(1)))
    return int(np.prod([sizes[a] for a in re.findall(r"'([^']*)'", over.group(2))] or [1]))
  return jax.device_count()


def collective_bytes(hlo: str) -> dict:
  """Bytes sent per device by each kind of collective in an HLO module (ring/all-to-all model)."""
  out = {}
  for line in hlo.splitlines():
    m = COLLECTIVE.search(line)
    if not m:
      continue
    result, op = m.group(1), m.group(2)
    size = sum(
      DTYPE_BYTES[d] * int(np.prod([int(x) for x in dims.split(",") if x] or [1])) for d, dims in SHAPE.findall(result)
    )
    n = group_size(line)
    # A ring all-reduce sends 2(n-1)/n of its buffer, all-gather/all-to-all (n-1)/n (a device's own block
    # stays), a reduce-scatter (n-1)/n of its input (n times the result that the HLO line shows), a
    # collective-permute all of it (source and target differ).
    factor = {"all-reduce": 2 * (n - 1) / n, "collective-permute": 1.0, "reduce-scatter": n - 1}.get(op, (n - 1) / n)
    out[op] = out.get(op, 0.0) + factor * size
  return out


def step_bytes(compress: bool, correction: float, model: str) -> dict:
  c = digits.get_config()
  c.sync = "step"  # the correction is the per-step filter's
  c.num_cpu_devices, c.model, c.correction, c.compress_correction = 0, model, correction, compress
  shape = (8, 8, 1) if model == "cnn" else (32, 32, 3)
  # Without the resampling branch: its exchange (which also moves the residuals) is not the correction.
  return collective_bytes(Bench(c, shape, 10, {"resampling": False}).compiled().as_text())


def accuracy(compress: bool, seed: int, workdir: str) -> dict:
  c = digits.get_config()
  c.sync = "step"  # the correction is the per-step filter's
  c.seed, c.compress_correction, c.checkpoint_every_steps, c.num_cpu_devices = seed, compress, -1, 0
  c.log_every_steps = c.num_train_steps
  r = trainer.train_and_evaluate(c, workdir)
  return {"fused": r["fused"]["accuracy"], "ensemble": r["ensemble"]["accuracy"]}


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--model", default="cnn")
  args = parser.parse_args()
  logging.getLogger("ipf_jax").disabled = True

  base = step_bytes(False, 0.0, args.model)
  exact = step_bytes(False, 0.5, args.model)
  comp = step_bytes(True, 0.5, args.model)
  rows = []
  for name, b in (
    ("lambda=0 (no correction)", base),
    ("lambda=0.5 exact psum", exact),
    ("lambda=0.5 int8 compressed", comp),
  ):
    total = sum(b.values())
    rows.append(
      {
        "step": name,
        **{k: b.get(k, 0.0) / 1e3 for k in ("all-reduce", "all-to-all", "all-gather")},
        "total_kB": total / 1e3,
        "correction_kB": (total - sum(base.values())) / 1e3,
      }
    )
  corr_exact = sum(exact.values()) - sum(base.values())
  corr_comp = sum(comp.values()) - sum(base.values())
  print(f"\n1. Bytes sent per device per step by collectives ({args.model}, 8 particles on 8 devices), kB")
  print_table(rows, ["step", "all-reduce", "all-to-all", "all-gather", "total_kB", "correction_kB"])
  print(f"correction: exact / compressed = {corr_exact / corr_comp:.2f}x fewer bytes")

  acc = {True: [], False: []}
  with tempfile.TemporaryDirectory() as tmp:
    for seed in range(args.seeds):
      for compress in (False, True):
        acc[compress].append(accuracy(compress, seed, os.path.join(tmp, f"{compress}-{seed}")))
  rows = []
  for compress in (False, True):
    f = np.array([a["fused"] for a in acc[compress]]) * 100
    e = np.array([a["ensemble"] for a in acc[compress]]) * 100
    rows.append(
      {
        "correction": "compressed" if compress else "exact",
        "fused_acc": f"{f.mean():.2f} ± {f.std():.2f}",
        "ensemble_acc": f"{e.mean():.2f} ± {e.std():.2f}",
      }
    )
  print(f"\n2. Digits test accuracy, {args.seeds} seeds, digits config (300 steps)")
  print_table(rows, ["correction", "fused_acc", "ensemble_acc"])
  diff = np.mean([a["fused"] for a in acc[True]]) - np.mean([a["fused"] for a in acc[False]])
  print_summary(
    {
      "benchmark": "compression",
      "model": args.model,
      "correction_bytes_exact": corr_exact,
      "correction_bytes_compressed": corr_comp,
      "bytes_ratio": corr_exact / corr_comp,
      "fused_accuracy_difference_points": float(100 * diff),
      "seeds": args.seeds,
    }
  )


if __name__ == "__main__":
  main()

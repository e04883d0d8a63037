"""What weighing on common examples costs (issue: Uncertainty, item 3): ``weigh_on=common`` against ``own``.

  python -m benchmarks.weigh_common                  # 8 CPU devices (set below), digits CNN
  python -m benchmarks.weigh_common --model resnet_tiny --image_size 32 --common_examples 2,8
  python -m benchmarks.weigh_common --shape 28,28,1 --common_examples 2   # the CNN on Fashion-MNIST's images

``weigh_on=own`` weighs each particle by its training loss, which the step computes anyway.
``weigh_on=common`` also scores every particle on the same examples (``common_examples`` from each
particle's part of the batch: P x that many in all), one more forward pass without gradients. Both
steps are ipf compiled without the resampling branch (P = the device count): XLA's cost analysis counts a
``cond`` at its most expensive branch whether or not it runs, and the branch's resample-move noise would
set the peak; the weights are still computed. Per variant: the compiled step's FLOPs per device
(``cost_analysis``), its peak memory (``memory_analysis``), and its time (medians of repeated steps in
alternating rounds, in one process), each ÷ ``own``, and the extra GFLOP per device.
Prints a table and ``SUMMARY {json}``.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

from benchmarks.common import measure, memory_mib, print_summary, print_table  # noqa: E402
from benchmarks.common import Timed, config_for, image_shape  # noqa: E402


def flops(compiled) -> float:
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # a list of one dict in older jaxlibs
  if not cost or "flops" not in cost:
    raise SystemExit(f"XLA's cost analysis gives no FLOP count on the {jax.default_backend()} backend")
  return float(cost["flops"])


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="cnn")
  parser.add_argument("--image_size", type=int, default=32)
  parser.add_argument("--per_particle_batch", type=int, default=16)
  parser.add_argument("--common_examples", default="2,8", help="a comma list: the values of common_examples")
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--shape", default="", help="H,W,C of the images (default: the digits' 8,8,1 for the CNN)")
  args = parser.parse_args()
  dims = args.shape.split(",") if args.shape else []
  if args.shape and (len(dims) != 3 or not all(d.strip().isdigit() and int(d) > 0 for d in dims)):
    parser.error(f"--shape {args.shape!r}: three positive integers, height,width,channels (e.g. 28,28,1)")
  shape = tuple(int(d) for d in dims) or None
  p = jax.device_count()
  base, no_branch = dict(mode="ipf", num_particles=p), {"resampling": False}
  variants = {"own": Timed(config_for(args, **base), args, no_branch, shape=shape)}
  for k in args.common_examples.split(","):
    variants[f"common, {k} per particle"] = Timed(
      config_for(args, **base, weigh_on="common", common_examples=int(k)), args, no_branch, shape=shape
    )
  compiled = {k: v.bench.compiled() for k, v in variants.items()}
  cost = {k: flops(c) for k, c in compiled.items()}
  peak = {k: memory_mib(c)["peak"] for k, c in compiled.items()}
  t = measure(variants, args.repeats, args.rounds)
  rows = [
    {
      "variant": k,
      "GFLOP/device": cost[k] / 1e9,
      "extra GFLOP": (cost[k] - cost["own"]) / 1e9,
      "FLOPs vs own": cost[k] / cost["own"],
      "peak MiB": peak[k],
      "peak vs own": peak[k] / peak["own"],
      "step ms": 1e3 * t[k],
      "time vs own": t[k] / t["own"],
    }
    for k in variants
  ]
  shown = "x".join(map(str, shape or image_shape(args)))
  print(
    f"\nweigh_on ({p} particles on {p} devices, {args.model} on {shown} images, "
    f"{args.per_particle_batch} examples per particle)"
  )
  print_table(rows, list(rows[0]))
  print_summary(
    {
      "benchmark": "weigh_common",
      "devices": p,
      "model": args.model,
      "shape": list(shape or image_shape(args)),
      "per_particle_batch": args.per_particle_batch,
      "flops_over_own": {k: cost[k] / cost["own"] for k in variants},
      "extra_gflop_per_device": {k: (cost[k] - cost["own"]) / 1e9 for k in variants},
      "peak_over_own": {k: peak[k] / peak["own"] for k in variants},
      "time_over_own": {k: t[k] / t["own"] for k in variants},
    }
  )


if __name__ == "__main__":
  main()

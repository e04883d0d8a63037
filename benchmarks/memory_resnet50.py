"""Per-device memory of the compiled ResNet-50 IPF train step (XLA memory_analysis, no execution).

  python -m benchmarks.memory_resnet50 [--image_size 224] [--per_device_batch 64]

Compiles on the CPU for one device (mesh (1, 1)), so the numbers are XLA CPU's
buffer assignment: a GPU's differs in detail, but the ratios between variants
(remat, particle sharing, particles per device) are what this measures. The
per-device batch is fixed (the cost of one DDP replica), split over the L
particles of the device.
"""

from __future__ import annotations

import argparse

import jax

from benchmarks.common import Bench, memory_mib, print_summary, print_table
from configs import imagenet_r50

# Stem and first stage shared by all particles (the seed's "base layers").
SHARED = "^(conv_init|bn_init|stage1_)"


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--image_size", type=int, default=224)
  parser.add_argument("--per_device_batch", type=int, default=64)
  parser.add_argument("--model", default="resnet50")
  parser.add_argument("--variants", default="", help="comma-separated subset of the variants (default: all)")
  args = parser.parse_args()

  variants = [
    ("L=1", 1, False, ""),
    ("L=2", 2, False, ""),
    ("L=4", 4, False, ""),
    ("L=2 remat", 2, True, ""),
    ("L=2 shared stem+stage1", 2, False, SHARED),
    ("L=4 shared stem+stage1", 4, False, SHARED),
  ]
  if args.variants:
    keep = [v.strip() for v in args.variants.split(",")]
    unknown = sorted(set(keep) - {v[0] for v in variants})
    if unknown:
      parser.error(f"--variants: unknown {unknown}; choose from {[v[0] for v in variants]}")
    variants = [v for v in variants if v[0] in keep]
  rows = []
  for name, particles, remat, shared in variants:
    config = imagenet_r50.get_config()
    config.sync = "step"  # the per-step program, as measured
    config.model = args.model
    config.image_size = args.image_size
    config.num_particles = particles
    config.global_batch_size = args.per_device_batch
    config.num_devices = 1
    config.remat = remat
    config.shared_params = shared
    bench = Bench(config, (args.image_size, args.image_size, 3), 1000)
    mem = memory_mib(bench.compiled())
    rows.append({"variant": name, **mem})
    print(f"compiled {name}: peak {mem['peak']:.1f} MiB", flush=True)
  base = {r["variant"]: r["peak"] for r in rows}
  for r in rows:
    r["peak / L=1"] = r["peak"] / base["L=1"] if "L=1" in base else float("nan")
  print(
    f"\n{args.model}, {args.image_size}x{args.image_size}, {args.per_device_batch} images per device, "
    f"bfloat16 compute, float32 params/optimizer; MiB per device"
  )
  print_table(rows, ["variant", "arguments", "temporaries", "peak", "peak / L=1"])
  ratio = lambda a, b: base[a] / base[b] if a in base and b in base else None
  print_summary(
    {
      "benchmark": "memory_resnet50",
      "model": args.model,
      "image_size": args.image_size,
      "per_device_batch": args.per_device_batch,
      "backend": jax.default_backend(),
      "peak_mib": base,
      "remat_over_plain_L2": ratio("L=2 remat", "L=2"),
      "shared_over_plain_L2": ratio("L=2 shared stem+stage1", "L=2"),
      "shared_over_plain_L4": ratio("L=4 shared stem+stage1", "L=4"),
      "L2_over_L1": ratio("L=2", "L=1"),
      "L4_over_L1": ratio("L=4", "L=1"),
    }
  )


if __name__ == "__main__":
  main()

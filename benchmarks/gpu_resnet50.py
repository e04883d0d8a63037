"""The accelerator check: ResNet-50 or ViT-B/16 train step images/s, MFU and peak memory for DDP and ipf, and a trace.

  python -m benchmarks.gpu_resnet50                       # on a GPU: ResNet-50, bf16, 256 images/device, < 8 min
  python -m benchmarks.gpu_resnet50 --model vit_b16       # ViT-B/16 with the ViT-S/16 recipe's AdamW, bf16
  python -m benchmarks.gpu_resnet50 --trace /tmp/trace    # also a jax.profiler trace of the fastest ipf L=2
  python -m benchmarks.gpu_resnet50 --tiny                # anywhere: resnet_tiny, 32x32, 8 images/device
  python -m benchmarks.gpu_resnet50 --dtype float16       # GPUs without bfloat16 (V100, T4): dynamic loss scaling
  python -m benchmarks.gpu_resnet50 --tiny --model vit_ti16   # anywhere: ViT-Ti, 8 x 8 patches of 32x32

A ResNet trains with ``configs/imagenet_r50.py``'s recipe (SGD with momentum); a ViT (``--model vit_*``) with
``configs/imagenet_vit_s16.py``'s (AdamW with a bfloat16 first moment, clipping, weight decay, mixup 0.2).

Variants, each on all local devices with the same images per device (the
cost of one DDP replica, split over the L particles of a device):
``ddp`` (one model), ``ipf L=1`` (one particle per device), and ``ipf L=2``
with each ``particle_loop`` (``vmap``: the particles' convolutions batched,
i.e. grouped convolutions; ``map``: ``lax.map``, one after the other;
``unroll``: a Python loop). For each: compile seconds, per-device peak memory
(XLA's ``memory_analysis`` of the compiled step), step time (median of
repeats, variants alternating), images/s and MFU (the model FLOPs of a step,
from XLA's cost analysis of the lowered step, divided by time and the device's
dense 16-bit peak, where known).
Prints a table and ``SUMMARY {json}``.
"""

from __future__ import annotations

import argparse
import os
import time

import jax

from benchmarks.common import Bench, measure, memory_mib, print_summary, print_table
from configs import imagenet_r50, imagenet_vit_s16

# Dense bf16/fp16 peak FLOP/s by device kind (vendor specs), for MFU.
PEAK_16BIT = {
  "NVIDIA H200": 989e12,
  "NVIDIA H100 80GB HBM3": 989e12,
  "NVIDIA A100-SXM4-80GB": 312e12,
  "NVIDIA A100-SXM4-40GB": 312e12,
}
VARIANTS = {
  "ddp": ("ddp", 1, "vmap"),
  "ipf L=1": ("ipf", 1, "vmap"),
  "ipf L=2 vmap": ("ipf", 2, "vmap"),
  "ipf L=2 map": ("ipf", 2, "map"),
  "ipf L=2 unroll": ("ipf", 2, "unroll"),
}


def make(variant, args, devices):
  mode, per_device, loop = VARIANTS[variant]
  config = (imagenet_vit_s16 if args.model.startswith("vit") else imagenet_r50).get_config()
  config.sync = "step"  # the per-step program, as measured (BENCHMARKS.md "GPU")
  config.model, config.image_size, config.dtype = args.model, args.image_size, args.dtype
  config.vit_patch_size = args.patch_size
  config.mode, config.particle_loop = mode, loop
  config.num_particles = 1 if mode == "ddp" else per_device * devices
  config.global_batch_size = args.per_device_batch * devices
  return Bench(config, (args.image_size, args.image_size, 3), 1000)


class Timed:
  """One variant: compiled once, then its own state stepped on one fixed batch."""

  def __init__(self, variant, args, devices):
    t = time.perf_counter()
    self.bench = make(variant, args, devices)
    self.compiled = self.bench.compiled()
    self.compile_s = time.perf_counter() - t
    self.memory = memory_mib(self.compiled)
    # FLOPs of the lowered step: a GPU's compiled module hides its convolutions in library calls, which
    # XLA's cost analysis does not count; and lax.map's loop body counts once: the MFU takes the largest.
    cost = self.bench.train_step.lower(self.bench.abstract, self.bench.batch_abstract()).cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    self.flops = float(cost.get("flops", 0.0)) if cost else 0.0
    self.state, self.batch = self.bench.init(), self.bench.synthetic_batch()

  def __call__(self):
    self.state, metrics = self.compiled(self.state, self.batch)
    return metrics["loss"]


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument(
    "--tiny", action="store_true", help="resnet_tiny (or --model vit_ti16 in 8x8 patches), 32x32, 8 images per device"
  )
  parser.add_argument("--model", default="resnet50")
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
  parser.add_argument("--image_size", type=int, default=224)
  parser.add_argument("--patch_size", type=int, default=0, help="vits: 0 = the name's (16 for vit_b16)")
  parser.add_argument("--per_device_batch", type=int, default=256)
  parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from: " + ", ".join(VARIANTS))
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--trace", default="", help="write a jax.profiler trace of 3 steps of the fastest ipf L=2 here")
  args = parser.parse_args()
  if args.tiny:
    args.image_size, args.per_device_batch, args.repeats, args.rounds = 32, 8, 3, 2
    args.model, args.patch_size = ("vit_ti16", 8) if args.model.startswith("vit") else ("resnet_tiny", 0)
  devices = jax.device_count()
  kind = jax.devices()[0].device_kind
  names = [v.strip() for v in args.variants.split(",") if v.strip()]
  unknown = sorted(set(names) - set(VARIANTS))
  if unknown:
    parser.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
  print(
    f"{args.model} {args.image_size}x{args.image_size}, {args.per_device_batch} images/device, {args.dtype}, "
    f"{devices} x {kind}, jax {jax.__version__}",
    flush=True,
  )
  timed = {}
  for name in names:
    timed[name] = Timed(name, args, devices)
    print(
      f"compiled {name} in {timed[name].compile_s:.0f} s: peak {timed[name].memory['peak']:.0f} MiB per device",
      flush=True,
    )
  times = measure(timed, args.repeats, args.rounds)
  l2 = {name: times[name] for name in names if name.startswith("ipf L=2")}
  if args.trace and l2:
    best = min(l2, key=l2.get)
    jax.block_until_ready(timed[best]())
    with jax.profiler.trace(os.path.join(args.trace, best.replace(" ", "_").replace("=", ""))):
      for _ in range(3):
        loss = timed[best]()
      jax.block_until_ready(loss)
    print(f"profiler trace of 3 steps of {best} (the fastest ipf L=2) in {args.trace}", flush=True)
  images = args.per_device_batch * devices
  peak = PEAK_16BIT.get(kind) if args.dtype != "float32" else None
  # Model FLOPs of one step: the same images through the same network in every variant.
  model_flops = max(v.flops for v in timed.values())
  rows = []
  for name in names:
    t, v = times[name], timed[name]
    rows.append(
      {
        "variant": name,
        "compile_s": v.compile_s,
        "peak_MiB": v.memory["peak"],
        "step_ms": 1e3 * t,
        "images_per_s": images / t,
        "vs ddp": (times["ddp"] / t) if "ddp" in times else float("nan"),
        "mfu": model_flops / t / peak if peak and model_flops else float("nan"),
      }
    )
  print_table(rows, ["variant", "compile_s", "peak_MiB", "step_ms", "images_per_s", "vs ddp", "mfu"])
  loops = {r["variant"].split()[-1]: r["images_per_s"] for r in rows if r["variant"].startswith("ipf L=2")}
  print_summary(
    {
      "benchmark": "gpu_resnet50",
      "model": args.model,
      "optimizer": timed[names[0]].bench.config.optimizer,
      "devices": devices,
      "device_kind": kind,
      "backend": jax.default_backend(),
      "jax": jax.__version__,
      "per_device_batch": args.per_device_batch,
      "dtype": args.dtype,
      "rows": rows,
      "best_particle_loop_L2": max(loops, key=loops.get) if loops else None,
    }
  )


if __name__ == "__main__":
  main()

"""Images/s of the ResNet-50 IPF train step on synthetic data: ddp vs 2 particles per device.

  python -m benchmarks.gpu_resnet50                       # on a GPU host: ResNet-50, bf16, 256 images/device
  python -m benchmarks.gpu_resnet50 --tiny                # anywhere: resnet_tiny, 32x32, 8 images/device
  python -m benchmarks.gpu_resnet50 --dtype float16       # GPUs without bfloat16 (V100, T4): dynamic loss scaling

Prints a table and one JSON line (``SUMMARY {...}``) with images/s of each
mode, their ratio and the model FLOPs utilisation (XLA's cost analysis of the
compiled step, divided by time and the device's peak bf16 FLOP/s when known).
The two modes are measured alternately in one process; medians of repeats.
"""
from __future__ import annotations

import argparse

import jax

from benchmarks.common import Bench, measure, print_summary, print_table
from configs import imagenet_r50

# Dense bf16/fp16 peak FLOP/s by device kind (vendor specs), for MFU.
PEAK_16BIT = {"NVIDIA H200": 989e12, "NVIDIA H100 80GB HBM3": 989e12, "NVIDIA A100-SXM4-80GB": 312e12,
             "NVIDIA A100-SXM4-40GB": 312e12}


def make(mode, args, devices):
  config = imagenet_r50.get_config()
  config.model, config.image_size = args.model, args.image_size
  config.dtype = args.dtype
  config.num_particles = 1 if mode == "ddp" else 2 * devices
  config.mode = "ddp" if mode == "ddp" else "ipf"
  config.global_batch_size = args.per_device_batch * devices
  return Bench(config, (args.image_size, args.image_size, 3), 1000)


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--tiny", action="store_true", help="resnet_tiny, 32x32, 8 images per device (CPU smoke)")
  parser.add_argument("--model", default="resnet50")
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
  parser.add_argument("--image_size", type=int, default=224)
  parser.add_argument("--per_device_batch", type=int, default=256)
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--rounds", type=int, default=3)
  args = parser.parse_args()
  if args.tiny:
    args.model, args.image_size, args.per_device_batch, args.repeats, args.rounds = "resnet_tiny", 32, 8, 3, 2
  devices = jax.device_count()
  benches = {m: make(m, args, devices) for m in ("ddp", "ipf_2_per_device")}
  states, batches, flops = {}, {}, {}
  for m, b in benches.items():
    states[m] = b.init()
    batches[m] = b.synthetic_batch()
    cost = b.compiled().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    flops[m] = float(cost.get("flops", 0.0)) if cost else 0.0

  def step(m):
    def run():
      states[m], metrics = benches[m].train_step(states[m], batches[m])
      return metrics["loss"]
    return run

  times = measure({m: step(m) for m in benches}, args.repeats, args.rounds)
  images = args.per_device_batch * devices
  kind = jax.devices()[0].device_kind
  peak = PEAK_16BIT.get(kind) if args.dtype != "float32" else None
  rows = []
  for m in benches:
    t = times[m]
    rows.append({"mode": m, "step_ms": 1e3 * t, "images_per_s": images / t,
                 "mfu": (flops[m] * devices / t / (peak * devices)) if peak and flops[m] else float("nan")})
  by = {r["mode"]: r for r in rows}
  print(f"{args.model} {args.image_size}x{args.image_size}, {args.per_device_batch} images/device, {args.dtype}, "
        f"{devices} x {kind}")
  print_table(rows, ["mode", "step_ms", "images_per_s", "mfu"])
  print_summary({"benchmark": "gpu_resnet50", "model": args.model, "devices": devices,
                 "device_kind": kind, "per_device_batch": args.per_device_batch, "dtype": args.dtype,
                 "ddp_images_per_s": by["ddp"]["images_per_s"],
                 "ipf2_images_per_s": by["ipf_2_per_device"]["images_per_s"],
                 "ipf2_over_ddp": by["ipf_2_per_device"]["images_per_s"] / by["ddp"]["images_per_s"],
                 "ddp_mfu": by["ddp"]["mfu"], "ipf2_mfu": by["ipf_2_per_device"]["mfu"]})


if __name__ == "__main__":
  main()

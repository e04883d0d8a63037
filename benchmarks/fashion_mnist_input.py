"""The input pipeline on real files against the train step (issue: Real data, item 5), in one process.

  python -m benchmarks.fashion_mnist_input --data_dir DIR [--configs fashion_mnist,fashion_mnist_r18]
                                           [--batches 200] [--rounds 3] [--randaugment 2,10]

For each config, on 8 fake CPU devices: images/s of (a) the TFDS pipeline
alone (``TFDSDataset.train_batches``: read, shuffle, decode, pad-4 crop +
flip, normalise, batch; host arrays, as the trainer gets them), (b) the train
step alone on one batch already on the devices (median of ``--repeats``
calls), (c) the two together as the trainer runs them (each pipeline batch
placed on the devices, then the step; no prefetch thread). Rounds alternate
(a), (b), (c) so that drift on a shared machine hits each alike; the table
has the median over rounds and the ratio (a) / (b), the pipeline's headroom
(target >= 2). ``--randaugment L,M``: (d) the pipeline with RandAugment(L, M) after the crop and flip,
in the same rounds. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import importlib
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import Bench, print_summary, print_table  # noqa: E402
from ipf_jax.data import tfds_input  # noqa: E402
from ipf_jax.spmd import layout


def pipeline_rate(ds, batch: int, n: int, seed: int) -> float:
  stream = ds.train_batches(0, batch, seed)
  next(stream)  # the first batch fills the shuffle buffer
  t = time.perf_counter()
  for _ in range(n):
    next(stream)
  return n * batch / (time.perf_counter() - t)


def step_rate(bench: Bench, repeats: int) -> float:
  state, batch = bench.state, bench.synthetic_batch()
  times = []
  for i in range(repeats + 2):
    t = time.perf_counter()
    state, m = bench.train_step(state, batch)
    jax.block_until_ready(m)
    if i >= 2:
      times.append(time.perf_counter() - t)
  bench.state = state
  return bench.config.global_batch_size / float(np.median(times))


def together_rate(bench: Bench, ds, n: int, seed: int) -> float:
  config, state = bench.config, bench.state
  stream = ds.train_batches(0, config.global_batch_size, seed)
  next(stream)
  t = time.perf_counter()
  for _ in range(n):
    batch = layout.put_train_batch(next(stream), config.num_particles, bench.mesh)
    state, m = bench.train_step(state, batch)
  jax.block_until_ready(m)
  bench.state = state
  return n * config.global_batch_size / (time.perf_counter() - t)


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--data_dir", default=os.path.expanduser("~/tensorflow_datasets"))
  parser.add_argument("--configs", default="fashion_mnist,fashion_mnist_r18")
  parser.add_argument("--batches", type=int, default=200, help="pipeline batches per measurement")
  parser.add_argument("--repeats", type=int, default=10, help="step calls per measurement")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--r18_batches", type=int, default=10, help="batches per measurement for ResNet-18")
  parser.add_argument("--randaugment", default="", help="layers,magnitude: also the pipeline with RandAugment")
  args = parser.parse_args()
  augment = tuple(float(x) for x in args.randaugment.split(",")) if args.randaugment else None
  rows = []
  for name in args.configs.split(","):
    config = importlib.import_module(f"configs.{name}").get_config()
    config.data_dir, config.sync = args.data_dir, "step"  # the per-step step these rows timed
    ds = tfds_input.TFDSDataset(
      config.dataset, config.data_dir, config.image_size, shuffle_buffer=config.shuffle_buffer, small_images=True
    )
    with_ra = augment and tfds_input.TFDSDataset(
      config.dataset,
      config.data_dir,
      config.image_size,
      shuffle_buffer=config.shuffle_buffer,
      small_images=True,
      randaugment=(int(augment[0]), augment[1]),
    )
    config.num_cpu_devices = 0  # the forced 8 above
    bench = Bench(config, ds.image_shape, ds.num_classes)
    bench.state = bench.init()
    small = "r18" in name
    n = args.r18_batches if small else args.batches
    repeats = max(3, args.repeats // 3) if small else args.repeats
    rates = {"pipeline": [], "step": [], "together": [], **({"randaugment": []} if with_ra else {})}
    for r in range(args.rounds):
      rates["pipeline"].append(pipeline_rate(ds, config.global_batch_size, n, seed=r))
      if with_ra:
        rates["randaugment"].append(pipeline_rate(with_ra, config.global_batch_size, n, seed=r))
      rates["step"].append(step_rate(bench, repeats))
      rates["together"].append(together_rate(bench, ds, n, seed=r))
    med = {k: float(np.median(v)) for k, v in rates.items()}
    rows.append(
      {
        "config": name,
        "model": config.model,
        "batch": config.global_batch_size,
        "pipeline_img_s": med["pipeline"],
        "step_img_s": med["step"],
        "together_img_s": med["together"],
        "pipeline/step": med["pipeline"] / med["step"],
        **({"randaugment_img_s": med["randaugment"]} if with_ra else {}),
        "rounds": str([round(x) for x in rates["pipeline"]]),
      }
    )
    print(f"done {name}", flush=True)
  print(f"\n{jax.device_count()} CPU devices, {os.cpu_count()} cores; images/s, median of {args.rounds} rounds\n")
  columns = ["config", "model", "batch", "pipeline_img_s", "step_img_s", "together_img_s", "pipeline/step"]
  print_table(rows, columns + (["randaugment_img_s"] if augment else []))
  print_summary({"benchmark": "fashion_mnist_input", "rows": rows})


if __name__ == "__main__":
  main()

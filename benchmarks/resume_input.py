"""Time to the first batch of a run resumed at step k of an epoch: records skipped encoded vs decoded.

  python -m benchmarks.resume_input [--examples 4096] [--batch 64] [--image_size 224] [--repeats 3]

Writes a real TFDS dataset to a temporary directory first (random JPEG images of
``image_size`` x ``image_size`` x 3, ImageNet-sized; nothing is downloaded),
then reads it through ``TFDSDataset``'s training pipeline (shuffle, skip,
augment) from step k for several k, with the skipped records left encoded
(today's pipeline) and decoded before the skip (``SKIP_DECODING = False``, the
pipeline before). Medians of ``repeats``; both pipelines alternate. Reading the
skipped records themselves still costs I/O: the comparison says what decoding
them added.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np

from benchmarks.common import print_summary, print_table


def build(data_dir: str, examples: int, image_size: int):
  import tensorflow_datasets as tfds

  class ResumeBench(tfds.core.GeneratorBasedBuilder):
    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
      return tfds.core.DatasetInfo(
        builder=self,
        features=tfds.features.FeaturesDict(
          {
            "image": tfds.features.Image(shape=(image_size, image_size, 3), encoding_format="jpeg"),
            "label": tfds.features.ClassLabel(num_classes=10),
          }
        ),
      )

    def _split_generators(self, dl_manager):
      return {"train": self._generate_examples(examples, 0), "test": self._generate_examples(256, 1)}

    def _generate_examples(self, n, seed):
      rng = np.random.default_rng(seed)
      for i in range(n):
        # Smooth random images, JPEG-encoded like ImageNet's, so decoding costs what it does on real data.
        small = rng.integers(0, 256, (8, 8, 3), np.uint8)
        yield i, {"image": np.kron(small, np.ones((image_size // 8, image_size // 8, 1), np.uint8)), "label": i % 10}

  builder = ResumeBench(data_dir=data_dir)
  builder.download_and_prepare()
  return builder


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--examples", type=int, default=4096)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--image_size", type=int, default=224)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  from ipf_jax.data import tfds_input

  with tempfile.TemporaryDirectory() as data_dir:
    t = time.perf_counter()
    builder = build(data_dir, args.examples, args.image_size)
    print(f"wrote {args.examples} examples in {time.perf_counter() - t:.0f} s", flush=True)
    tfds_input.load_builder = lambda name, data_dir: builder
    ds = tfds_input.TFDSDataset("cifar10", None, image_size=32, shuffle_buffer=1024, small_images=True)
    per_epoch = ds.steps_per_epoch(args.batch)
    ks = sorted({0, per_epoch // 8, per_epoch // 2, per_epoch - 1})
    times = {(k, skip): [] for k in ks for skip in (True, False)}
    for _ in range(args.repeats):
      for k in ks:
        for skip in (True, False):
          tfds_input.SKIP_DECODING = skip
          t = time.perf_counter()
          next(ds.train_batches(k, args.batch, seed=0))
          times[(k, skip)].append(time.perf_counter() - t)
  med = {key: statistics.median(v) for key, v in times.items()}
  rows = [
    {
      "resumed at step": k,
      "skipped records": k * args.batch,
      "first batch s, skipped encoded": med[(k, True)],
      "vs k=0": med[(k, True)] / med[(0, True)],
      "first batch s, skipped decoded": med[(k, False)],
      "vs k=0 ": med[(k, False)] / med[(0, False)],
    }
    for k in ks
  ]
  print(
    f"\n{args.examples} examples of {args.image_size}x{args.image_size} JPEG, batch {args.batch}, "
    f"{per_epoch} steps per epoch, shuffle buffer 1024; medians of {args.repeats}"
  )
  print_table(rows, list(rows[0]))
  print_summary(
    {
      "benchmark": "resume_input",
      "steps_per_epoch": per_epoch,
      "batch": args.batch,
      "image_size": args.image_size,
      "first_batch_s": {str(k): {"encoded": med[(k, True)], "decoded": med[(k, False)]} for k in ks},
    }
  )


if __name__ == "__main__":
  main()

"""Video classification with IPF-DDP: a small R(2+1)D ResNet on TFDS's UCF-101 (the seed's Kinetics
experiment, at a size a workstation can hold).

  python examples/video_ucf101.py --workdir runs/ucf101 --data_dir /path/to/tfds [--steps 20000]

Needs ``ucf101`` prepared by TFDS in ``data_dir`` (``tfds build ucf101 --data_dir=...``: it downloads
the videos from the UCF site). Clips of ``num_frames`` frames (a random start and flip for training,
the centre for evaluation) at ``image_size`` x ``image_size``. Everything here is library use: the
model, the input pipeline and the config are this file's; ``tests/test_examples.py`` runs it on
``tfds.testing.mock_data``. Nothing has been trained on the real videos by this project.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from functools import partial
from typing import Iterator

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

import ipf_jax
from ipf_jax.data import tfds_input
from ipf_jax.data.errors import DataError


class Block2Plus1D(nn.Module):
  """Residual block of two (2+1)D convolutions: 1 x 3 x 3 spatial, then 3 x 1 x 1 temporal."""

  filters: int
  strides: tuple = (1, 1, 1)
  norm: nn.Module = nn.BatchNorm

  @nn.compact
  def __call__(self, x):
    conv = partial(nn.Conv, use_bias=False)
    y = x
    for i in range(2):
      t, h, w = self.strides if i == 0 else (1, 1, 1)
      y = conv(self.filters, (1, 3, 3), strides=(1, h, w))(y)
      y = conv(self.filters, (3, 1, 1), strides=(t, 1, 1))(y)
      y = self.norm(scale_init=nn.initializers.zeros_init() if i == 1 else nn.initializers.ones)(y)
      y = nn.relu(y) if i == 0 else y
    if x.shape != y.shape:
      x = self.norm()(conv(self.filters, (1, 1, 1), strides=self.strides)(x))
    return nn.relu(x + y)


class R2Plus1D(nn.Module):
  """R(2+1)D ResNet (Tran et al. 2018) with ``stage_sizes`` blocks per stage; BatchNorm over ``bn_axis_name``."""

  num_classes: int
  stage_sizes: tuple = (1, 1, 1)
  width: int = 16
  bn_axis_name: str | None = "data"

  @nn.compact
  def __call__(self, video, train: bool):
    norm = partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, axis_name=self.bn_axis_name)
    x = nn.Conv(self.width, (1, 5, 5), strides=(1, 2, 2), use_bias=False)(video)
    x = nn.relu(norm()(nn.Conv(self.width, (3, 1, 1), use_bias=False)(x)))
    for i, blocks in enumerate(self.stage_sizes):
      for j in range(blocks):
        strides = (2, 2, 2) if i > 0 and j == 0 else (1, 1, 1)
        x = Block2Plus1D(self.width * 2**i, strides, norm)(x)
    return nn.Dense(self.num_classes)(jnp.mean(x, axis=(1, 2, 3)))


@dataclasses.dataclass
class UCF101:
  """Clips from TFDS's ``ucf101`` (``tfds_input.load_builder``: one clear error when it is not prepared)."""

  data_dir: str | None = None
  num_frames: int = 8
  image_size: int = 64
  name: str = "ucf101"
  num_classes: int = 101
  process_local: bool = False

  def __post_init__(self):
    self.builder = tfds_input.load_builder("ucf101", self.data_dir)
    self.train_size = int(self.builder.as_dataset(split="train").cardinality())
    self.test_size = int(self.builder.as_dataset(split="test").cardinality())
    self.example = {
      "video": np.zeros((1, self.num_frames, self.image_size, self.image_size, 3), np.float32),
      "label": np.zeros((1,), np.int32),
    }

  def steps_per_epoch(self, global_batch_size: int) -> int:
    return self.train_size // global_batch_size

  def _clips(self, split: str, train: bool, seed: int, epoch: int):
    tf = tfds_input._tf()
    t, size = self.num_frames, self.image_size

    def clip(index, example):
      video = example["video"]
      length = tf.shape(video)[0]
      video = tf.tile(video, [tf.maximum(1, -(-t // length)), 1, 1, 1])  # loop a video shorter than a clip
      key = tf.stack([tf.cast(seed, tf.int64) * 1000003 + epoch, index])
      start = (
        tf.random.stateless_uniform([], key, 0, tf.shape(video)[0] - t + 1, tf.int32)
        if train
        else (tf.shape(video)[0] - t) // 2
      )
      frames = tf.image.resize(tf.cast(video[start : start + t], tf.float32) / 255.0, (size, size))
      if train:
        frames = tf.cond(tf.random.stateless_uniform([], key + 1) < 0.5, lambda: frames[:, :, ::-1], lambda: frames)
      return {"video": frames, "label": tf.cast(example["label"], tf.int32)}

    ds = self.builder.as_dataset(split=split, shuffle_files=False)
    if train:
      ds = ds.shuffle(1024, seed=seed + epoch, reshuffle_each_iteration=False)
    return ds.enumerate().map(clip, num_parallel_calls=tf.data.AUTOTUNE)

  def train_batches(self, start_step: int, global_batch_size: int, seed: int) -> Iterator[dict]:
    per_epoch, step = self.steps_per_epoch(global_batch_size), start_step
    while True:
      epoch, first = divmod(step, per_epoch)
      batches = self._clips("train", True, seed, epoch).batch(global_batch_size, drop_remainder=True)
      for batch in batches.skip(first).take(per_epoch - first):
        yield {k: v.numpy() for k, v in batch.items()}
        step += 1

  def eval_batches(self, batch_size: int) -> Iterator[dict]:
    for batch in self._clips("test", False, 0, 0).batch(batch_size):
      yield {k: v.numpy() for k, v in batch.items()}


def get_config():
  """8 particles; 8-frame clips at 64 x 64."""
  config = ipf_jax.default_config()
  config.dataset = "ucf101"
  config.num_particles = 8
  config.global_batch_size = 64
  config.eval_batch_size = 64
  config.num_train_steps = 20_000
  config.warmup_steps = 500
  config.base_lr = 0.1
  config.reference_batch_size = 64
  config.log_every_steps = 100
  config.checkpoint_every_steps = 1000
  return config


def main(workdir, data_dir=None, steps=None, num_frames=8, image_size=64, **overrides):
  config = get_config()
  if steps:
    config.num_train_steps = steps
  for k, v in overrides.items():
    config[k] = v
  data = UCF101(data_dir, num_frames=num_frames, image_size=image_size)
  task = ipf_jax.classification(R2Plus1D(num_classes=data.num_classes), inputs="video")
  return ipf_jax.train_and_evaluate(config, workdir, task=task, data=data)


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workdir", default="runs/ucf101")
  parser.add_argument("--data_dir", default=None)
  parser.add_argument("--steps", type=int, default=None)
  return parser.parse_args(argv)


if __name__ == "__main__":
  args = parse_args()
  try:
    main(args.workdir, args.data_dir, args.steps)
  except DataError as e:  # the data is not prepared: one line that says how to prepare it
    sys.exit(f"error: {e}")

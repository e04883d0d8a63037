"""An in-memory dataset whose batch order is a pure function of (seed, step)."""
from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np


@dataclasses.dataclass(frozen=True)
class ArrayDataset:
  name: str
  train_images: np.ndarray  # [N, H, W, C] float32
  train_labels: np.ndarray  # [N] int32
  test_images: np.ndarray
  test_labels: np.ndarray
  num_classes: int

  process_local = False  # train batches are the whole global batch (each process places its shards)

  @property
  def train_size(self) -> int:
    return len(self.train_labels)

  @property
  def test_size(self) -> int:
    return len(self.test_labels)

  @property
  def image_shape(self) -> tuple[int, ...]:
    return tuple(self.train_images.shape[1:])

  def steps_per_epoch(self, global_batch_size: int) -> int:
    return len(self.train_labels) // global_batch_size

  def train_batch(self, step: int, global_batch_size: int, seed: int) -> dict:
    """The ``global_batch_size`` examples of ``step``: epoch ``e`` is a fresh
    permutation from ``(seed, e)``, the last partial batch of an epoch is dropped.

    The order depends only on ``(seed, step)``, so a resumed run sees the data
    a never-interrupted run would.
    """
    per_epoch = self.steps_per_epoch(global_batch_size)
    if per_epoch == 0:
      raise ValueError(f"config.global_batch_size: {global_batch_size} is larger than the {self.name} training "
                       f"set ({len(self.train_labels)} examples); use a smaller batch")
    epoch, i = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(len(self.train_labels))
    idx = order[i * global_batch_size:(i + 1) * global_batch_size]
    return {"image": self.train_images[idx], "label": self.train_labels[idx]}

  def harder(self, train_fraction: float, label_noise: float, seed: int = 0) -> "ArrayDataset":
    """A fixed random ``train_fraction`` of the training set, with ``label_noise`` of its labels
    replaced by a uniformly drawn *other* class (symmetric noise). The test set is untouched."""
    rng = np.random.default_rng([seed, 7919])
    n = len(self.train_labels)
    keep = np.sort(rng.permutation(n)[:max(1, round(train_fraction * n))])
    labels = self.train_labels[keep].copy()
    noisy = rng.random(len(labels)) < label_noise
    labels[noisy] = (labels[noisy] + rng.integers(1, self.num_classes, noisy.sum())) % self.num_classes
    return dataclasses.replace(self, train_images=self.train_images[keep], train_labels=labels.astype(np.int32))

  def train_batches(self, start_step: int, global_batch_size: int, seed: int) -> Iterator[dict]:
    """``train_batch`` for ``start_step, start_step + 1, ...``."""
    step = start_step
    while True:
      yield self.train_batch(step, global_batch_size, seed)
      step += 1

  def eval_batches(self, batch_size: int) -> Iterator[dict]:
    """Test batches of exactly ``batch_size``; the last is zero-padded with ``mask = 0``."""
    n = len(self.test_labels)
    for start in range(0, n, batch_size):
      stop = min(start + batch_size, n)
      pad = batch_size - (stop - start)
      mask = np.concatenate([np.ones(stop - start, np.float32), np.zeros(pad, np.float32)])
      yield {"image": np.concatenate([self.test_images[start:stop],
                                      np.zeros((pad,) + self.image_shape, self.test_images.dtype)]),
             "label": np.concatenate([self.test_labels[start:stop], np.zeros(pad, self.test_labels.dtype)]),
             "mask": mask}

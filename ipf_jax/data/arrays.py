"""In-memory data whose batch order is a pure function of (seed, step): a dict of arrays per split.

``ArrayDataset(name, train={"image": X, "label": y}, test={...})`` takes any
keys and shapes (images and labels, regression inputs and targets, videos).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Optional

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class ArrayDataset:
  name: str
  train: dict  # {field: [N, ...] array}
  test: dict
  num_classes: Optional[int] = None  # classification only
  calibration: Optional["ArrayDataset"] = None  # held out of the train split by ``holdout``

  process_local = False  # train batches are the whole global batch (each process places its shards)
  eval_process_local = True  # eval batches are this process's part of the test set

  def __post_init__(self):
    for split in ("train", "test"):
      sizes = {k: len(v) for k, v in getattr(self, split).items()}
      if len(set(sizes.values())) != 1:
        raise ValueError(f"{self.name}: the {split} arrays have different lengths {sizes}")

  @property
  def train_size(self) -> int:
    return len(next(iter(self.train.values())))

  @property
  def test_size(self) -> int:
    return len(next(iter(self.test.values())))

  @property
  def example(self) -> dict:
    """One training example of each field, ``[1, ...]`` (what a model is initialised from)."""
    return {k: v[:1] for k, v in self.train.items()}

  def steps_per_epoch(self, global_batch_size: int) -> int:
    return self.train_size // global_batch_size

  def train_batch(self, step: int, global_batch_size: int, seed: int) -> dict:
    """The ``global_batch_size`` examples of ``step``: epoch ``e`` is a fresh
    permutation from ``(seed, e)``, the last partial batch of an epoch is dropped.

    The order depends only on ``(seed, step)``, so a resumed run sees the data
    a never-interrupted run would.
    """
    per_epoch = self.steps_per_epoch(global_batch_size)
    if per_epoch == 0:
      raise ValueError(
        f"config.global_batch_size: {global_batch_size} is larger than the {self.name} training "
        f"set ({self.train_size} examples); use a smaller batch"
      )
    epoch, i = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(self.train_size)
    idx = order[i * global_batch_size : (i + 1) * global_batch_size]
    return {k: v[idx] for k, v in self.train.items()}

  def harder(self, train_fraction: float, label_noise: float, seed: int = 0) -> "ArrayDataset":
    """A fixed random ``train_fraction`` of the training set, with ``label_noise`` of its labels
    replaced by a uniformly drawn *other* class (symmetric noise; classification). The test set is
    untouched."""
    rng = np.random.default_rng([seed, 7919])
    keep = np.sort(rng.permutation(self.train_size)[: max(1, round(train_fraction * self.train_size))])
    train = {k: v[keep] for k, v in self.train.items()}
    labels = train["label"].copy()
    noisy = rng.random(len(labels)) < label_noise
    labels[noisy] = (labels[noisy] + rng.integers(1, self.num_classes, noisy.sum())) % self.num_classes
    return dataclasses.replace(self, train={**train, "label": labels.astype(np.int32)})

  def holdout(self, fraction: float, seed: int = 0) -> "ArrayDataset":
    """The dataset without a fixed random ``fraction`` of its training set (fixed by ``seed``), which
    becomes ``calibration``, a dataset whose test split it is (e.g. to fit a temperature on). The name
    says what was held out, so that a checkpoint trained on other data is refused."""
    rng = np.random.default_rng([seed, 104_729])
    order = rng.permutation(self.train_size)
    cut = max(1, round(fraction * self.train_size))
    held, rest = np.sort(order[:cut]), np.sort(order[cut:])
    name = f"{self.name} ({fraction:g} held out)"
    calibration = dataclasses.replace(
      self,
      name=f"{self.name} (the {fraction:g} held out)",
      train={k: v[held[:1]] for k, v in self.train.items()},
      test={k: v[held] for k, v in self.train.items()},
    )
    return dataclasses.replace(
      self, name=name, train={k: v[rest] for k, v in self.train.items()}, calibration=calibration
    )

  def train_batches(self, start_step: int, global_batch_size: int, seed: int) -> Iterator[dict]:
    """``train_batch`` for ``start_step, start_step + 1, ...``."""
    step = start_step
    while True:
      yield self.train_batch(step, global_batch_size, seed)
      step += 1

  def eval_batches(self, batch_size: int) -> Iterator[dict]:
    """This process's part of the test set (the ``process_index``-th of ``process_count`` near-equal
    parts) in batches of at most ``batch_size`` (the evaluation pads and masks the last one)."""
    part = np.array_split(np.arange(self.test_size), jax.process_count())[jax.process_index()]
    for start in range(0, len(part), batch_size):
      idx = part[start : start + batch_size]
      yield {k: v[idx] for k, v in self.test.items()}

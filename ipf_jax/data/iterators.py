"""Any data as functions that give host batches (dicts of numpy arrays): ``Data``."""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Iterator, Optional


@dataclasses.dataclass(frozen=True)
class Data:
  """A run's data from your own functions.

  Attributes:
    train: ``start_step -> iterator`` of global batches (dicts of ``[G, ...]`` numpy arrays,
      ``G = config.global_batch_size``) from that step on. Give the same batches for the same steps
      and a resumed run is identical to an uninterrupted one. (BatchNorm re-estimation of the fused
      model reads ``train(0)`` beside the training stream: each call gives a fresh iterator.)
    eval: ``() -> iterable`` of batches of any size; the evaluation pads and masks them so that every
      example counts once.
    example: one example of each field the model reads, ``[1, ...]`` arrays.
    steps_per_epoch_fn: ``G -> steps per epoch`` (needed for ``num_epochs`` and ``warmup_epochs``);
      ``None`` = unknown.
    train_size, test_size: for messages and checks (``None``: not checked).
    process_local: ``train`` gives this process's part of each global batch (multi-host input).
    eval_process_local: ``eval`` gives this process's part of the eval set (each example in exactly one
      process's part, e.g. ``tfds.split_for_jax_process``), in batches of at most the size the
      evaluation asks for; ``False``: every process gives the whole set.
  """

  train: Callable[[int], Iterator[dict]]
  eval: Callable[[], Iterable[dict]]
  example: dict
  name: str = "data"
  steps_per_epoch_fn: Optional[Callable[[int], int]] = None
  train_size: Optional[int] = None
  test_size: Optional[int] = None
  num_classes: Optional[int] = None
  process_local: bool = False
  eval_process_local: bool = False

  def __post_init__(self):
    if not callable(self.train) or not callable(self.eval):
      raise TypeError(
        "ipf_jax.Data: train and eval are functions (train(start_step) -> iterator, eval() -> "
        "iterable), so that a resumed run can start at its step and each evaluation reads anew"
      )

  def steps_per_epoch(self, global_batch_size: int) -> Optional[int]:
    return self.steps_per_epoch_fn(global_batch_size) if self.steps_per_epoch_fn else None

  def train_batches(self, start_step: int, global_batch_size: int, seed: int) -> Iterator[dict]:
    return iter(self.train(start_step))

  def eval_batches(self, batch_size: int) -> Iterable[dict]:
    return self.eval()

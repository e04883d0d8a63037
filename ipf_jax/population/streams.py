"""The train step's random streams, named once (DESIGN.md §10): each purpose a ``fold_in`` of the step key."""

from __future__ import annotations

import enum

import jax


class Stream(enum.IntEnum):
  """The random streams of a train step (DESIGN.md §10), each ``stream(step_key, purpose)`` of the step key
  ``fold_in(rng, step)``; ``FUSED_BN`` is folded into ``rng`` itself. Named once, used by name."""

  RESAMPLE = 0  # the systematic resampling's one shared uniform
  JITTER = 1  # the noise on resampled copies
  MODEL = 2  # the model's own randomness (dropout): per particle and data shard, per micro-batch
  AUGMENT = 3  # the task's train-time augmentation in the step (mixup): per particle, per micro-batch
  FUSED_BN = 2**31 - 1  # the fused model's BatchNorm re-estimation (from ``rng``, not a step key)


def stream(key, purpose: Stream):
  """``fold_in(key, purpose)``: the key of one of ``Stream``'s purposes."""
  return jax.random.fold_in(key, int(purpose))

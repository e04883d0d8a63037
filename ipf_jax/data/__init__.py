"""Datasets by name: ``create_dataset(config)``."""
from __future__ import annotations

import ml_collections

from ipf_jax.data.arrays import ArrayDataset

DATASETS = ("digits",)


def create_dataset(config: ml_collections.ConfigDict) -> ArrayDataset:
  if config.dataset == "digits":
    from ipf_jax.data import digits
    return digits.load()
  raise ValueError(f"config.dataset: unknown dataset {config.dataset!r}; use one of {', '.join(DATASETS)}")

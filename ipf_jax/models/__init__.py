"""Model zoo: ``create_model(config, num_classes, bn_axis_name)``."""
from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
import ml_collections

from ipf_jax.models.cnn import CNN

MODELS = ("cnn",)


def create_model(config: ml_collections.ConfigDict, num_classes: int, bn_axis_name: Optional[str] = None):
  """The Flax module named by ``config.model``."""
  dtype = jnp.dtype(config.dtype)
  if config.model == "cnn":
    return CNN(num_classes=num_classes, features=tuple(config.cnn_features), dtype=dtype,
               bn_momentum=config.bn_momentum, bn_axis_name=bn_axis_name)
  raise ValueError(f"config.model: unknown model {config.model!r}; use one of {', '.join(MODELS)}")

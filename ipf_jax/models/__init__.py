"""Model zoo: ``create_model(config, num_classes, bn_axis_name)``."""
from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
import ml_collections

from ipf_jax.models import resnet
from ipf_jax.models.cnn import CNN

RESNETS = {"resnet18": resnet.ResNet18, "resnet34": resnet.ResNet34, "resnet50": resnet.ResNet50,
           "resnet101": resnet.ResNet101, "resnet152": resnet.ResNet152, "resnet_tiny": resnet.ResNetTiny}
MODELS = ("cnn",) + tuple(RESNETS)


def create_model(config: ml_collections.ConfigDict, num_classes: int, bn_axis_name: Optional[str] = None):
  """The Flax module named by ``config.model``."""
  dtype = jnp.dtype(config.dtype)
  if config.model == "cnn":
    return CNN(num_classes=num_classes, features=tuple(config.cnn_features), dtype=dtype,
               bn_momentum=config.bn_momentum, bn_axis_name=bn_axis_name)
  if config.model in RESNETS:
    return RESNETS[config.model](num_classes=num_classes, dtype=dtype, bn_momentum=config.bn_momentum,
                                 bn_axis_name=bn_axis_name, small_inputs=config.small_inputs, remat=config.remat)
  raise ValueError(f"config.model: unknown model {config.model!r}; use one of {', '.join(MODELS)}")

"""The model zoo: ``create_model(config, num_classes, bn_axis_name)`` builds the CNN or a ResNet (18 to 200)
named by ``config.model``, and ``model_from_fields`` rebuilds one from the fields an export records. Plain
Flax Linen modules written for one particle and one device's batch; BatchNorm averages over the axis it is
given (``"data"``: SyncBN within a particle's group). Any other Flax module, Linen or NNX, works too
(``ipf_jax.Task``)."""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from ipf_jax.errors import ConfigError
from ipf_jax.models import resnet
from ipf_jax.models.cnn import CNN

RESNETS = {
  "resnet18": resnet.ResNet18,
  "resnet34": resnet.ResNet34,
  "resnet50": resnet.ResNet50,
  "resnet101": resnet.ResNet101,
  "resnet152": resnet.ResNet152,
  "resnet_tiny": resnet.ResNetTiny,
}
MODELS = ("cnn",) + tuple(RESNETS)
# The config fields that rebuild a zoo model (an export stores them with the number of classes).
MODEL_FIELDS = ("model", "cnn_features", "small_inputs", "dtype", "bn_momentum")


def create_model(config, num_classes: int, bn_axis_name: Optional[str] = None):
  """The Flax module named by ``config.model`` (any mapping with the ``MODEL_FIELDS``)."""
  dtype = jnp.dtype(config["dtype"])
  name = config["model"]
  if name == "cnn":
    return CNN(
      num_classes=num_classes,
      features=tuple(config["cnn_features"]),
      dtype=dtype,
      bn_momentum=config["bn_momentum"],
      bn_axis_name=bn_axis_name,
    )
  if name in RESNETS:
    return RESNETS[name](
      num_classes=num_classes,
      dtype=dtype,
      bn_momentum=config["bn_momentum"],
      bn_axis_name=bn_axis_name,
      small_inputs=config["small_inputs"],
      remat=config.get("remat", False),
    )
  raise ConfigError("model", f"unknown model {name!r}; use one of {', '.join(MODELS)}")


def model_fields(config, num_classes: int) -> dict:
  """What ``model_from_fields`` needs to rebuild ``create_model(config, num_classes)``."""
  fields = {k: (list(config[k]) if isinstance(config[k], tuple) else config[k]) for k in MODEL_FIELDS}
  return {**fields, "num_classes": num_classes}


def model_from_fields(fields: dict):
  """The zoo model ``model_fields`` describes (no BatchNorm axis: plain Flax use)."""
  return create_model(fields, fields["num_classes"])

"""The model zoo: ``create_model(config, num_classes, bn_axis_name)`` builds the CNN, a ResNet (18 to 152) or
a Vision Transformer (``vit_ti16`` to ``vit_g14``, big_vision's) named by ``config.model``, and
``model_from_fields`` rebuilds one from the fields an export records. Plain Flax Linen modules written for one
particle and one device's batch; BatchNorm averages over the axis it is given (``"data"``: SyncBN within a
particle's group). Any other Flax module, Linen or NNX, works too (``ipf_jax.Task``)."""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from ipf_jax.errors import ConfigError
from ipf_jax.models import resnet, vit
from ipf_jax.models.cnn import CNN

RESNETS = {
  "resnet18": resnet.ResNet18,
  "resnet34": resnet.ResNet34,
  "resnet50": resnet.ResNet50,
  "resnet101": resnet.ResNet101,
  "resnet152": resnet.ResNet152,
  "resnet_tiny": resnet.ResNetTiny,
}
MODELS = ("cnn",) + tuple(RESNETS) + tuple(vit.VARIANTS)
BLOCKED = tuple(RESNETS) + tuple(vit.VARIANTS)  # the models whose blocks are built by blocks.make (BLOCKS)
# The config fields that rebuild a zoo model (an export stores them with the number of classes).
MODEL_FIELDS = (
  "model",
  "cnn_features",
  "small_inputs",
  "dtype",
  "bn_momentum",
  "vit_patch_size",
  "vit_pool",
  "vit_posemb",
  "vit_scan",
  "dropout",
  "stochastic_depth",
  "remat",
)
# Fields added after exports were first written, with the value those exports were made with.
_DEFAULTS = {
  "vit_patch_size": 0,
  "vit_pool": "tok",
  "vit_posemb": "learn",
  "vit_scan": False,
  "dropout": 0.0,
  "stochastic_depth": 0.0,
  "remat": False,
}


def rngs(config) -> tuple:
  """The random streams the zoo model draws in train mode: ``dropout`` for a ViT with dropout or stochastic
  depth, else none."""
  random = config.get("dropout", 0.0) or config.get("stochastic_depth", 0.0)
  return ("dropout",) if config["model"] in vit.VARIANTS and random else ()


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
  if name in vit.VARIANTS:
    get = lambda k: config.get(k, _DEFAULTS[k])
    return vit.create(
      name,
      num_classes,
      patch_size=get("vit_patch_size") or None,
      posemb=get("vit_posemb"),
      pool=get("vit_pool"),
      dropout=get("dropout"),
      stochastic_depth=get("stochastic_depth"),
      remat=get("remat"),
      scan=get("vit_scan"),
      dtype=dtype,
    )
  raise ConfigError("model", f"unknown model {name!r}; use one of {', '.join(MODELS)}")


def check_input(config, example: dict) -> None:
  """A ViT's patches must tile the images of ``example`` (a batch, ``image`` ``[..., H, W, C]``); other models
  take any size."""
  name = config["model"]
  if name not in vit.VARIANTS:
    return
  patch = config.get("vit_patch_size", 0) or vit.VARIANTS[name][1]
  h, w = example["image"].shape[-3:-1]
  if h % patch or w % patch:
    fits = [p for p in range(2, min(h, w) + 1) if h % p == 0 and w % p == 0]
    raise ConfigError(
      "vit_patch_size" if config.get("vit_patch_size", 0) else "model",
      f"{name}'s {patch} x {patch} patches do not tile the {h} x {w} images"
      + (f"; set vit_patch_size to one of {fits}" if fits else "; use another model"),
    )


def model_fields(config, num_classes: int) -> dict:
  """What ``model_from_fields`` needs to rebuild ``create_model(config, num_classes)``."""
  value = lambda k: config[k] if k in config else _DEFAULTS[k]
  fields = {k: (list(value(k)) if isinstance(value(k), tuple) else value(k)) for k in MODEL_FIELDS}
  return {**fields, "num_classes": num_classes}


def model_from_fields(fields: dict):
  """The zoo model ``model_fields`` describes (no BatchNorm axis: plain Flax use)."""
  return create_model(fields, fields["num_classes"])

"""The model zoo: ``create_model(ModelSpec(...), bn_axis_name)`` builds the CNN, a ResNet (18 to 152) or
a Vision Transformer (``vit_ti16`` to ``vit_g14``, big_vision's) named by ``ModelSpec.model``, and
``model_from_fields`` rebuilds one from the fields an export records. Plain Flax Linen modules written for one
particle and one device's batch; BatchNorm averages over the axis it is given (``"data"``: SyncBN within a
particle's group). Any other Flax module, Linen or NNX, works too (``ipf_jax.Task``)."""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A zoo model's constructor arguments, each named as the config field it comes from (``ipf_jax.config.read
  .model_spec`` reads them; an export stores them, ``fields()``, and ``from_fields`` rebuilds the spec)."""

  model: str
  num_classes: int
  dtype: str = "float32"
  cnn_features: tuple = (32, 64, 128)
  small_inputs: bool = False
  bn_momentum: float = 0.9
  # Fields added after exports were first written: the defaults are the values those exports were made with.
  vit_patch_size: int = 0
  vit_pool: str = "tok"
  vit_posemb: str = "learn"
  vit_scan: bool = False
  dropout: float = 0.0
  stochastic_depth: float = 0.0
  remat: bool = False

  def fields(self) -> dict:
    """The spec as JSON-ready fields (what an export records)."""
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()}

  @classmethod
  def from_fields(cls, fields: dict) -> "ModelSpec":
    """The spec an export's fields describe (fields it predates take their defaults; unknown keys ignored)."""
    known = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in fields.items() if k in known}
    if "cnn_features" in values:
      values["cnn_features"] = tuple(values["cnn_features"])
    return cls(**values)

  @property
  def rngs(self) -> tuple:
    """The random streams the model draws in train mode: ``dropout`` for a ViT with dropout or stochastic
    depth, else none."""
    return ("dropout",) if self.model in vit.VARIANTS and (self.dropout or self.stochastic_depth) else ()


def create_model(spec: ModelSpec, bn_axis_name: Optional[str] = None):
  """The Flax module ``spec`` describes; its BatchNorm averages over ``bn_axis_name`` (None: plain Flax use)."""
  dtype = jnp.dtype(spec.dtype)
  name = spec.model
  if name == "cnn":
    return CNN(
      num_classes=spec.num_classes,
      features=tuple(spec.cnn_features),
      dtype=dtype,
      bn_momentum=spec.bn_momentum,
      bn_axis_name=bn_axis_name,
    )
  if name in RESNETS:
    return RESNETS[name](
      num_classes=spec.num_classes,
      dtype=dtype,
      bn_momentum=spec.bn_momentum,
      bn_axis_name=bn_axis_name,
      small_inputs=spec.small_inputs,
      remat=spec.remat,
    )
  if name in vit.VARIANTS:
    return vit.create(
      name,
      spec.num_classes,
      patch_size=spec.vit_patch_size or None,
      posemb=spec.vit_posemb,
      pool=spec.vit_pool,
      dropout=spec.dropout,
      stochastic_depth=spec.stochastic_depth,
      remat=spec.remat,
      scan=spec.vit_scan,
      dtype=dtype,
    )
  raise ConfigError("model", f"unknown model {name!r}; use one of {', '.join(MODELS)}")


def check_input(spec: ModelSpec, example: dict) -> None:
  """A ViT's patches must tile the images of ``example`` (a batch, ``image`` ``[..., H, W, C]``); other models
  take any size."""
  name = spec.model
  if name not in vit.VARIANTS:
    return
  patch = spec.vit_patch_size or vit.VARIANTS[name][1]
  h, w = example["image"].shape[-3:-1]
  if h % patch or w % patch:
    fits = [p for p in range(2, min(h, w) + 1) if h % p == 0 and w % p == 0]
    raise ConfigError(
      "vit_patch_size" if spec.vit_patch_size else "model",
      f"{name}'s {patch} x {patch} patches do not tile the {h} x {w} images"
      + (f"; set vit_patch_size to one of {fits}" if fits else "; use another model"),
    )


def model_from_fields(fields: dict):
  """The zoo model an export's fields describe (no BatchNorm axis: plain Flax use)."""
  return create_model(ModelSpec.from_fields(fields))

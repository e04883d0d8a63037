"""The fused model as plain Flax files (DESIGN.md §6): ``WORKDIR/fused_model.msgpack`` holds
``{"params", "batch_stats"}`` (flax msgpack); ``fused_model.json`` the model-zoo fields that rebuild the module
(``None`` for a model the user brought: pass it to ``load_fused``)::

  model, variables = ipf_jax.load_fused("WORKDIR/fused_model")
  logits = model.apply(variables, images, train=False)
"""

from __future__ import annotations

import json
from typing import Optional

import jax
import numpy as np
from flax import serialization

from ipf_jax import files
from ipf_jax.spmd import nnx_bridge


def export_fused(variables: dict, path: str, model_fields: Optional[dict] = None) -> None:
  """Writes ``path.msgpack`` (the variables) and ``path.json`` (``model_fields``: what rebuilds a zoo model).
  Call on process 0; each file is written atomically."""
  host = jax.tree.map(np.asarray, jax.device_get(variables))
  files.write_atomic(path + ".msgpack", serialization.msgpack_serialize(host))
  files.write_atomic(path + ".json", json.dumps({"model": model_fields}, indent=1))


def load_fused(path: str, model=None):
  """``(module, variables)`` of an exported fused model (``path`` without extension).

  ``model``: the Flax module to return (a model you brought); by default the zoo model the export names.
  A Linen module is returned as given (``module.apply(variables, x, train=False)``); an NNX module or
  constructor comes back as an ``nnx.Module`` holding the fused values, in eval mode (``module(x)``).
  """
  with open(path + ".msgpack", "rb") as f:
    variables = serialization.msgpack_restore(f.read())
  if isinstance(model, nnx_bridge.NNXModel) or (model is not None and nnx_bridge.is_nnx(model)):
    adapted = model if isinstance(model, nnx_bridge.NNXModel) else nnx_bridge.NNXModel(model)
    return adapted.module(variables), variables
  if model is None:
    with open(path + ".json") as f:
      fields = json.load(f)
    fields = fields.get("model", fields)  # exports before the "model" key held the fields at the top
    if not fields:
      raise ValueError(f"{path}.json names no zoo model: pass the Flax module you trained, load_fused(path, model=...)")
    from ipf_jax.models import model_from_fields

    model = model_from_fields(fields)
  return model, variables

"""Export of the fused model for plain Flax use.

``WORKDIR/fused_model.msgpack`` holds ``{"params", "batch_stats"}`` (flax
msgpack); ``fused_model.json`` the fields that rebuild the module. Load with

  model, variables = ipf_jax.export.load_fused("WORKDIR/fused_model")
  logits = model.apply(variables, images, train=False)

or, without this package, ``flax.serialization.msgpack_restore(open(path, "rb").read())``
and the matching ``flax.linen`` module.
"""
from __future__ import annotations

import json

import jax
import ml_collections
import numpy as np
from flax import serialization

from configs import default
from ipf_jax.models import create_model

MODEL_FIELDS = ("model", "cnn_features", "small_inputs", "dtype", "bn_momentum")


def export_fused(variables: dict, config: ml_collections.ConfigDict, num_classes: int, path: str) -> None:
  """Writes ``path.msgpack`` and ``path.json`` (call on process 0)."""
  host = jax.tree.map(np.asarray, jax.device_get(variables))
  with open(path + ".msgpack", "wb") as f:
    f.write(serialization.msgpack_serialize(host))
  meta = {k: (list(config[k]) if isinstance(config[k], tuple) else config[k]) for k in MODEL_FIELDS}
  meta["num_classes"] = num_classes
  with open(path + ".json", "w") as f:
    json.dump(meta, f, indent=1)


def load_fused(path: str):
  """``(module, variables)`` of an exported fused model (``path`` without extension)."""
  with open(path + ".json") as f:
    meta = json.load(f)
  config = default.get_config()
  for k in MODEL_FIELDS:
    config[k] = tuple(meta[k]) if isinstance(meta[k], list) else meta[k]
  with open(path + ".msgpack", "rb") as f:
    variables = serialization.msgpack_restore(f.read())
  return create_model(config, meta["num_classes"]), variables

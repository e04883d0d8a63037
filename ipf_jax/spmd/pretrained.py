"""A population started from one checkpoint (``config.init_from``): every particle takes the same loaded
values, except the parameters ``config.init_reinit`` matches, which start fresh per particle (a new head for
a new label set). The fused model of such a population averages networks that share a start: a learned soup.

What can be loaded: this project's exported fused model (``WORKDIR/fused_model``, its ``.msgpack``, or the
workdir itself), or a plain Flax file: msgpack of ``{"params": ..., "batch_stats": ...}`` or of the params
alone, or ``.npz`` of ``/``-joined names (big_vision's checkpoints; a ``params/`` prefix is dropped). Shapes
are checked on the host, before anything compiles: a parameter that does not fit, one the model lacks and one
the file lacks are each named, with the regex that would leave them fresh.
"""

from __future__ import annotations

import os
import re

import jax
import numpy as np
from flax import serialization, traverse_util

from ipf_jax.errors import ConfigError

COLLECTIONS = ("params", "batch_stats")


def _resolve(path: str) -> str:
  """The file ``path`` names: itself, ``path.msgpack``, or a workdir's ``fused_model.msgpack``."""
  for candidate in (path, path + ".msgpack", os.path.join(path, "fused_model.msgpack")):
    if os.path.isfile(candidate):
      return candidate
  raise ConfigError(
    "init_from",
    f"{path!r} is neither a file, an export (PATH.msgpack) nor a workdir holding fused_model.msgpack; give an "
    "exported fused model, a run's workdir, a Flax msgpack file or a .npz of flattened names",
  )


def read(path: str) -> dict:
  """``{collection: {"a/b/kernel": array}}`` from the file ``path`` names (``_resolve``)."""
  file = _resolve(path)
  try:
    if file.endswith(".npz"):
      with np.load(file) as z:
        flat = {k: z[k] for k in z.files}
      return _by_collection(flat)
    with open(file, "rb") as f:
      tree = serialization.msgpack_restore(f.read())
  except (OSError, ValueError, KeyError) as e:
    raise ConfigError("init_from", f"{file} could not be read ({e}); give a Flax msgpack or .npz file") from None
  if not isinstance(tree, dict) or not tree:
    raise ConfigError("init_from", f"{file} holds no parameter tree")
  if set(tree) <= set(COLLECTIONS) and "params" in tree:
    return {c: traverse_util.flatten_dict(tree[c], sep="/") for c in COLLECTIONS if tree.get(c)}
  return {"params": traverse_util.flatten_dict(tree, sep="/")}


def _by_collection(flat: dict) -> dict:
  out = {}
  for name, value in flat.items():
    collection, _, rest = name.partition("/")
    if collection in COLLECTIONS and rest:
      out.setdefault(collection, {})[rest] = value
    else:
      out.setdefault("params", {})[name] = value
  return out


def for_model(path: str, reinit: str, variables_shape: dict) -> dict:
  """The loaded values that start the model, ``{collection: {path: array}}`` cast to the model's dtypes:
  every parameter but those ``reinit`` matches (``re.search`` on ``/``-joined paths). ``variables_shape``:
  the model's ``init`` output as ``ShapeDtypeStruct``s. Batch statistics load where the file has them."""
  loaded, regex = read(path), re.compile(reinit) if reinit else None
  fresh = (lambda name: bool(regex.search(name))) if regex else (lambda name: False)
  start, problems = {}, []
  for collection in COLLECTIONS:
    want = traverse_util.flatten_dict(variables_shape.get(collection, {}), sep="/")
    have = loaded.get(collection)
    if not want or (collection == "batch_stats" and not have):
      continue
    have = have or {}
    missing = sorted(k for k in want if k not in have and not fresh(k))
    extra = sorted(k for k in have if k not in want and not fresh(k))
    wrong = sorted(
      f"{k} {tuple(np.shape(have[k]))} there, {tuple(want[k].shape)} here"
      for k in want
      if k in have and not fresh(k) and tuple(np.shape(have[k])) != tuple(want[k].shape)
    )
    problems += [f"{collection} the model has and the file lacks: {', '.join(missing)}"] if missing else []
    problems += [f"{collection} the file has and the model lacks: {', '.join(extra)}"] if extra else []
    problems += [f"{collection} of another shape: {'; '.join(wrong)}"] if wrong else []
    start[collection] = {k: np.asarray(have[k], want[k].dtype) for k in want if k in have and not fresh(k)}
  if problems:
    raise ConfigError(
      "init_from",
      f"{path} does not fit this model: " + " | ".join(problems) + ". Set config.init_reinit to a regex of the "
      "parameters to initialise fresh instead (e.g. '^head/' for a new label set), or load a checkpoint of "
      "this model",
    )
  if not start.get("params"):
    raise ConfigError("init_from", f"init_reinit={reinit!r} leaves nothing of {path} to load")
  return start


def place(variables: dict, start: dict) -> dict:
  """``variables`` with the leaves ``start`` holds replaced by them (inside the jitted init)."""
  out = dict(variables)
  for collection, values in start.items():
    flat = traverse_util.flatten_dict(variables[collection], sep="/")
    flat.update({k: jax.numpy.asarray(v) for k, v in values.items()})
    out[collection] = traverse_util.unflatten_dict(flat, sep="/")
  return out

"""A population started from one checkpoint (``config.init_from``): every particle takes the same loaded
values, except the parameters ``config.init_reinit`` matches, which start fresh per particle (a new head for
a new label set). The fused model of such a population averages networks that share a start: a learned soup.

What can be loaded: this project's exported fused model (``WORKDIR/fused_model``, its ``.msgpack``, or the
workdir itself); one particle of a run's newest checkpoint (``init_particle = i``: ``WORKDIR/checkpoints/
<step>/state``, read on the host with orbax, shared parameters merged back); or a plain Flax file: msgpack of
``{"params": ..., "batch_stats": ...}`` or of the params alone, or ``.npz`` of ``/``-joined names
(big_vision's checkpoints; a ``params/`` prefix is dropped). Shapes are checked on the host, before anything
compiles: a parameter that does not fit, one the model lacks and one the file lacks are each named, with the
regex that would leave them fresh. A ViT's blocks load in either layout: a checkpoint of unrolled blocks
(``.../encoderblock_{i}/...``, big_vision's and the zoo's default) into a scanned model (``vit_scan``:
``.../encoderblock/...`` stacked), and back.
"""

from __future__ import annotations

import logging
import os
import re

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import serialization, traverse_util

from ipf_jax import files
from ipf_jax.errors import ConfigError
from ipf_jax.models import vit
from ipf_jax.spmd import sharing

COLLECTIONS = ("params", "batch_stats")
log = logging.getLogger("ipf_jax")


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


def read(path: str, particle: int = -1) -> dict:
  """``{collection: {"a/b/kernel": array}}`` from the file ``path`` names (``_resolve``), or with
  ``particle >= 0`` that particle of the newest checkpoint in the workdir ``path``."""
  if particle >= 0:
    return read_particle(path, particle)
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


def read_particle(workdir: str, particle: int) -> dict:
  """Particle ``particle`` of the newest whole checkpoint in ``workdir`` (``checkpoints/<step>/state``; a damaged
  newer one is passed over with a warning, as a resume does), as numpy: its parameters (with the shared ones
  merged back) and batch statistics."""
  root = os.path.join(workdir, "checkpoints")
  step, damaged = files.newest_whole(root)  # the resume's reader: a damaged checkpoint is never loaded
  for bad, why in damaged.items():
    log.warning("init_from: the checkpoint of step %d in %s is damaged (%s); reading an older one", bad, root, why)
  if step is None:
    found = f"only damaged ones ({', '.join(f'step {k}: {w}' for k, w in damaged.items())})" if damaged else "none"
    raise ConfigError(
      "init_particle",
      f"{workdir!r} holds no whole checkpoint (checkpoints/<step>: {found}): give a run's workdir, or "
      "init_particle=-1 for an exported fused model or a Flax file",
    )
  where = os.path.join(root, str(step), "state")
  try:
    with ocp.StandardCheckpointer() as ckptr:
      tree = ckptr.metadata(where).item_metadata.tree
      wanted = {k: tree[k] for k in ("params", "batch_stats", "shared_params") if tree.get(k) is not None}
      restore = ocp.args.PyTreeRestore(
        item=wanted,
        restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), wanted),
        partial_restore=True,
      )
    with ocp.PyTreeCheckpointer() as ckptr:
      state = ckptr.restore(where, args=restore)
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    raise ConfigError("init_from", f"{where} could not be read ({type(e).__name__}: {e})") from None
  num = len(jax.tree.leaves(state["params"])[0])
  if particle >= num:
    raise ConfigError("init_particle", f"must be < {num}: the checkpoint at {where} holds {num} particles")
  one = jax.tree.map(lambda x: np.asarray(x[particle]), {k: state[k] for k in ("params", "batch_stats") if k in state})
  params = sharing.merge(one["params"], jax.tree.map(np.asarray, state.get("shared_params") or {}))
  out = {"params": traverse_util.flatten_dict(params, sep="/")}
  if one.get("batch_stats"):
    out["batch_stats"] = traverse_util.flatten_dict(one["batch_stats"], sep="/")
  return out


def _by_collection(flat: dict) -> dict:
  out = {}
  for name, value in flat.items():
    collection, _, rest = name.partition("/")
    if collection in COLLECTIONS and rest:
      out.setdefault(collection, {})[rest] = value
    else:
      out.setdefault("params", {})[name] = value
  return out


def for_model(path: str, reinit: str, variables_shape: dict, particle: int = -1) -> dict:
  """The loaded values that start the model, ``{collection: {path: array}}`` cast to the model's dtypes:
  every parameter but those ``reinit`` matches (``re.search`` on ``/``-joined paths). ``variables_shape``:
  the model's ``init`` output as ``ShapeDtypeStruct``s. Batch statistics load where the file has them.
  ``particle >= 0``: that particle of the newest checkpoint of the workdir ``path`` (``read_particle``)."""
  loaded, regex = read(path, particle), re.compile(reinit) if reinit else None
  fresh = (lambda name: bool(regex.search(name))) if regex else (lambda name: False)
  start, problems = {}, []
  for collection in COLLECTIONS:
    want = traverse_util.flatten_dict(variables_shape.get(collection, {}), sep="/")
    have = loaded.get(collection)
    if not want or (collection == "batch_stats" and not have):
      continue
    have = vit.as_layout(have or {}, want)
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

"""Particle sharing (seed 000 §4.2): parameters matched by a regex are stored
once for all particles, follow the weighted consensus gradient and never move
in resampling; the rest stays per particle.

Parameter paths are ``/``-joined module and parameter names, e.g.
``conv_init/kernel`` or ``stage1_block1/Conv_0/kernel``.
"""

from __future__ import annotations

import re

from flax import traverse_util


def split(params, pattern: str):
  """``(per_particle, shared)``: the leaves whose path matches ``pattern`` (``re.search``) go to ``shared``."""
  if not pattern:
    return params, {}
  flat = traverse_util.flatten_dict(params, sep="/")
  regex = re.compile(pattern)
  shared = {k: v for k, v in flat.items() if regex.search(k)}
  rest = {k: v for k, v in flat.items() if not regex.search(k)}
  return traverse_util.unflatten_dict(rest, sep="/"), traverse_util.unflatten_dict(shared, sep="/")


def merge(per_particle, shared):
  """The full parameter tree of one particle (or of the fused model)."""
  if not shared:
    return per_particle
  flat = traverse_util.flatten_dict(per_particle, sep="/")
  flat.update(traverse_util.flatten_dict(shared, sep="/"))
  return traverse_util.unflatten_dict(flat, sep="/")

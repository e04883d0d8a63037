"""FSDP: each particle's parameters and optimizer state sharded over its group's ``"data"`` devices (DESIGN.md §2).

Which leaves are sharded is big_vision's rule (``sharding.py``, ``fsdp(axis, min_size_to_shard_mb)``; its
default 4 MiB is 1 here, ``config.fsdp_min_size_mb``, and a leaf of exactly the threshold is sharded, where
big_vision keeps it whole): a parameter of at least ``min_bytes`` per particle is split
over ``"data"`` along its largest dimension that the axis size divides (the last of equal ones); smaller leaves,
and leaves no dimension of which divides, stay whole on every device of the group; Adam's moments and SGD's
momentum are sharded as their parameters are (``like_params``). The layout is a property of the
state's arrays: every jitted function reads it from their types (``specs_of``), and a checkpoint restores onto
any layout (the global arrays are the same).

Inside ``shard_map`` a sharded leaf is a device's shard. The forward pass gathers the particle
(``gather``: ``all_gather`` over ``"data"``, whose transpose is a reduce-scatter, so each device's gradient
arrives as its shard of the mean over the group), and whatever sums over a particle's weights (norms,
finiteness, jitter) reads ``dims``: ``-1`` for a replicated leaf, else the sharded dimension of the ``[P, ...]``
leaf. Element-wise work (the optimizer's update, the correction's and fusion's ``psum`` over ``"particle"``,
the exchange's ``ppermute``) runs on shards as it is and moves ``1 / Dd`` of the bytes.
"""

from __future__ import annotations

import contextlib
import math
import re
from typing import Any, Optional

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util
from jax import lax
from jax.sharding import PartitionSpec as P

from ipf_jax.models import blocks
from ipf_jax.spmd.mesh import DATA, PARTICLE

REPLICATED = -1  # ``dims`` entry of a leaf that every device of the group holds whole


def leaf_dim(shape: tuple[int, ...], itemsize: int, size: int, min_bytes: float) -> int:
  """The dimension of a ``[P, ...]`` leaf to shard over ``size`` devices, or ``REPLICATED``."""
  if size <= 1 or len(shape) < 2 or math.prod(shape[1:]) * itemsize < min_bytes:
    return REPLICATED
  for d in sorted(range(1, len(shape)), key=lambda d: (-shape[d], -d)):
    if shape[d] % size == 0:
      return d
  return REPLICATED


def spec(dim: int) -> P:
  """The ``PartitionSpec`` of a per-particle leaf sharded along ``dim`` (``REPLICATED``: ``P("particle")``)."""
  return P(PARTICLE) if dim == REPLICATED else P(PARTICLE, *([None] * (dim - 1)), DATA)


def tree_specs(tree, size: int, min_bytes: float):
  """``PartitionSpec``s for the ``[P, ...]`` leaves of ``tree`` (arrays or ``ShapeDtypeStruct``s)."""
  return jax.tree.map(lambda x: spec(leaf_dim(tuple(x.shape), np.dtype(x.dtype).itemsize, size, min_bytes)), tree)


def like_params(opt_state, param_specs):
  """The optimizer state's specs: a leaf shaped as a parameter is sharded as that parameter is (Adam's moments,
  SGD's momentum, whatever their dtype: a bfloat16 moment under the threshold still follows its float32
  parameter), any other leaf (a count) whole."""
  by_shape = {}
  for partition, shape in param_specs:
    by_shape.setdefault(shape, partition)
  return jax.tree.map(lambda x: by_shape.get(tuple(x.shape), P(PARTICLE)), opt_state)


def data_dim(partition: Any) -> int:
  """The dimension a ``PartitionSpec`` shards over ``"data"``, or ``REPLICATED``."""
  for d, entry in enumerate(tuple(partition)):
    names = entry if isinstance(entry, tuple) else (entry,)
    if DATA in names:
      if d == 0:
        raise ValueError(
          f"a particle leaf sharded {partition}: its first dimension is the particle axis, which only "
          '"particle" may shard; place the state with state.state_shardings (config.fsdp shards a later one)'
        )
      return d
  return REPLICATED


def specs_of(tree):
  """The per-particle ``PartitionSpec``s that ``tree``'s arrays carry (inside ``jit``: their types): a leaf
  sharded over ``"data"`` keeps its spec, any other is ``P("particle")``."""

  def one(x):
    sharding = getattr(jax.typeof(x), "sharding", None)
    partition = getattr(sharding, "spec", None)
    return spec(REPLICATED if partition is None else data_dim(partition))

  return jax.tree.map(one, tree)


def dims_of(specs):
  """``dims`` (an int per leaf) from a tree of ``PartitionSpec``s."""
  return jax.tree.map(data_dim, specs, is_leaf=lambda x: isinstance(x, P))


def is_sharded(dims) -> bool:
  """Whether any leaf is a shard (``dims`` None: none is)."""
  return any(d != REPLICATED for d in jax.tree.leaves(dims))


def replicated(tree):
  """``dims`` for a tree whose leaves are all whole (shared parameters)."""
  return jax.tree.map(lambda _: REPLICATED, tree)


def shards(dims) -> Optional[tuple]:
  """What ``particle_filter.resample`` needs to cut a copy's jitter into shards: ``(dims in leaf order,
  "data")``, or None when no leaf is a shard."""
  return (tuple(jax.tree.leaves(dims)), DATA) if is_sharded(dims) else None


def summary(abstract_state) -> str:
  """One line on what ``config.fsdp`` sharded (from an abstract state's shardings): leaves, the share of the
  bytes, and the parameters and optimizer state per device against whole particles."""
  leaves = jax.tree.leaves((abstract_state.params, abstract_state.opt_state))
  dims = [data_dim(x.sharding.spec) for x in leaves]
  size = leaves[0].sharding.mesh.shape[DATA] if leaves else 1
  nbytes = lambda x: x.size * x.dtype.itemsize
  here = [math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in leaves]
  whole = sum(b * (size if d != REPLICATED else 1) for b, d in zip(here, dims))
  share = sum(nbytes(x) for x, d in zip(leaves, dims) if d != REPLICATED) / max(sum(map(nbytes, leaves)), 1)
  mib = lambda b: f"{b / 2**20:.1f} MiB"
  return (
    f"fsdp: {sum(d != REPLICATED for d in dims)} of {len(leaves)} parameter and optimizer-state leaves "
    f"({100 * share:.0f}% of the bytes) sharded over the {size} devices of each group: {mib(sum(here))} per "
    f"device, {mib(whole)} with whole particles"
  )


# ---- inside shard_map ------------------------------------------------------------------------------------------


def gather(tree, dims, invariant: bool = False):
  """One particle's whole leaves from its shards (per-particle code: the ``[P]`` axis is gone, so a leaf's
  sharded dimension is ``dims - 1``). The transpose of this gather is a reduce-scatter over ``"data"``.
  ``invariant``: the result typed the same on every device of the group (forward-only uses whose output
  leaves ``shard_map`` replicated: fusion, evaluation). With no leaf a shard (``dims`` None or all
  ``REPLICATED``) the tree comes back as it is."""
  if not is_sharded(dims):
    return tree
  to = "invarying" if invariant else "varying"

  def one(x, d):
    return x if d == REPLICATED else lax.all_gather(x, DATA, axis=d - 1, tiled=True, to=to)

  return jax.tree.map(one, tree, dims)


class BlockGather:
  """``config.fsdp_gather="block"``: a model whose blocks gather their own parameters as they run
  (``models.blocks``; ``pattern``, ``Task.blocks``: the regex that the ``/``-joined module path of each
  block matches whole, ``re.fullmatch``).

  Used as a context manager around one trace of the model::

    with BlockGather(dims, task.blocks) as gather:
      outputs = task.apply({"params": gather.outside(params), ...}, ...)

  ``outside(params)``: the particle with its leaves outside the blocks gathered and the blocks' left as
  a device's shards. Inside the ``with``, each block built by ``models.blocks.make`` calls
  ``gather(path, block_params, remat, stacked)`` as it runs: the whole parameters of the block at ``path``
  (leaves ``dims`` does not hold, the shared ones, are whole; ``stacked``: the leading axes of a stored leaf
  that the block's slice lacks, 1 in the body of ``nn.scan``). On leaving, ``check()``: every sharded leaf inside
  the blocks was gathered by its block, and the blocks are recomputed in the backward pass (without it
  each gathered block is kept for the backward pass, as the whole particle is by
  ``fsdp_gather="particle"``, and the second gather buys nothing). A ``pattern`` that does not describe
  the model's blocks is named, not left to a shape error: when Flax's shape error leaves the ``with``,
  ``watch`` (an ``nn.intercept_methods`` interceptor) has noted the module handed a shard. Other misuses
  of a shard (arithmetic on it outside a module, a module nested in a block that reads its parent's
  parameters) surface as JAX's or Flax's own error."""

  def __init__(self, dims, pattern: str):
    self.pattern = pattern
    self.dims = traverse_util.flatten_dict(dims, sep="/")
    self.matched = {k for k in self.dims if self._in_block(k)}  # the blocks' leaves, sharded or whole
    self.inside = {k for k in self.matched if self.dims[k] != REPLICATED}
    self.gathered: set[str] = set()
    self.kept: dict[str, None] = {}  # the blocks that ran without remat, in order
    self.failed: Optional[str] = None  # the module whose parameters Flax found the wrong shape
    self._installed: Optional[contextlib.ExitStack] = None

  def __enter__(self) -> "BlockGather":
    if self._installed is not None:
      raise RuntimeError("this BlockGather is already in use (a nested with): make one for each trace of the model")
    self.gathered, self.kept, self.failed = set(), {}, None
    self._installed = contextlib.ExitStack()
    self._installed.enter_context(blocks.gathering(self))
    self._installed.enter_context(nn.intercept_methods(self.watch))
    return self

  def __exit__(self, kind, error, traceback) -> bool:
    self._installed.close()
    self._installed = None
    if error is None:
      self.check()
    elif isinstance(error, flax.errors.ScopeParamShapeError):
      self.check(error)  # a leaf that the pattern matches reached a module not built by blocks.make
    return False

  def _in_block(self, key: str) -> bool:
    """Whether the leaf ``key`` lies inside a module whose path ``pattern`` matches whole."""
    parts = key.split("/")
    return any(re.fullmatch(self.pattern, "/".join(parts[:i])) for i in range(1, len(parts)))

  def outside(self, params):
    flat = {k: REPLICATED if k in self.inside else d for k, d in self.dims.items()}
    return gather(params, traverse_util.unflatten_dict(flat, sep="/"))

  def __call__(self, path: tuple, block_params, remat: bool, stacked: int = 0):
    name = "/".join(path)
    if not re.fullmatch(self.pattern, name):
      raise ValueError(
        f"fsdp_gather='block': the block {name!r} (built by ipf_jax.models.blocks.make) is not matched by "
        f"Task.blocks={self.pattern!r}, so its parameters would be gathered twice or not at all; make the "
        "pattern match every block's path whole (a model's BLOCKS), or set fsdp_gather='particle'"
      )
    if not remat:
      self.kept[name] = None
    leaves = traverse_util.flatten_dict(block_params, sep="/")
    keys = {k: f"{name}/{k}" for k in leaves}
    self.gathered.update(key for key in keys.values() if key in self.inside)
    block_dims = {k: self.dims[key] if key in self.inside else REPLICATED for k, key in keys.items()}
    layered = [keys[k] for k, d in block_dims.items() if d != REPLICATED and d <= stacked]
    if layered:
      raise ValueError(
        f"fsdp_gather='block': the scanned block {name!r} holds {layered[0]!r} sharded along its layer axis (its "
        "largest), of which each iteration of the scan takes one slice; raise fsdp_min_size_mb above its size "
        "per particle so that it stays whole, or set fsdp_gather='particle'"
      )
    block_dims = {k: d if d == REPLICATED else d - stacked for k, d in block_dims.items()}
    return gather(block_params, traverse_util.unflatten_dict(block_dims, sep="/"))

  def watch(self, next_fun, args, kwargs, context):
    """An ``nn.intercept_methods`` interceptor: the innermost module through which Flax's
    ``ScopeParamShapeError`` passes is the one that was handed a device's shard."""
    try:
      return next_fun(*args, **kwargs)
    except flax.errors.ScopeParamShapeError:
      if self.failed is None:
        self.failed = "/".join(context.module.path)
      raise

  def check(self, error: Optional[Exception] = None) -> None:
    """After the model ran, or raised Flax's shape error ``error`` (a leaf that ``pattern`` matches reached a
    module not built by ``make`` as a device's shard, ``watch``): the error naming ``Task.blocks``."""
    missed = sorted(self.inside - self.gathered)
    if error is not None:
      missed = [k for k in missed if self.failed is not None and k.startswith(self.failed + "/")]
    if missed:
      raise ValueError(
        f"fsdp_gather='block': Task.blocks={self.pattern!r} matches sharded parameters that no block built by "
        f"ipf_jax.models.blocks.make gathered ({missed[0]!r}{' and more' if len(missed) > 1 else ''}): a "
        "module the pattern matches is not such a block, or did not run in training; a model's BLOCKS must "
        "name only blocks built by make that run, or set fsdp_gather='particle'"
      ) from error
    if error is None and self.kept:
      raise ValueError(
        f"fsdp_gather='block' gathers each block as it runs, which holds less only when the blocks are "
        f"recomputed in the backward pass, and {len(self.kept)} are not (first: {next(iter(self.kept))!r}); set "
        "remat=True (a model of your own: ipf_jax.models.blocks.make(..., remat=True)) or fsdp_gather='particle'"
      )


def sum_over_shards(values, dims):
  """``sum`` of per-leaf partial results (``[L]`` or scalars, a list in ``tree`` leaf order): a sharded leaf's
  result is the ``psum`` over ``"data"`` of its shards' (``dims`` None: every leaf whole, a plain ``sum``)."""
  if not is_sharded(dims):
    return sum(values)
  dims = jax.tree.leaves(dims)
  local = [v for v, d in zip(values, dims) if d == REPLICATED]
  spread = [v for v, d in zip(values, dims) if d != REPLICATED]
  total = sum(local) if local else 0.0
  return total + lax.psum(sum(spread), DATA) if spread else total


def squared_norms(tree, dims):
  """``[L]``: each local particle's ``||x||^2`` over its whole leaves (shards summed over ``"data"``)."""
  values = [jnp.sum(jnp.square(x).reshape(x.shape[0], -1), axis=1) for x in jax.tree.leaves(tree)]
  return sum_over_shards(values, dims)


def all_finite(tree, dims):
  """``[L]`` bool: every entry of each local particle's whole leaves is finite."""
  values = [(~jnp.isfinite(x)).reshape(x.shape[0], -1).any(axis=1).astype(jnp.int32) for x in jax.tree.leaves(tree)]
  return sum_over_shards(values, dims) == 0


# ---- the optimizer's global norm --------------------------------------------------------------------------------


def global_norm(tree, dims=None):
  """``optax.tree.norm`` of one particle's tree, over its whole leaves when ``dims`` says they are shards
  (``sum_over_shards``; ``None``: whole leaves)."""
  leaves = jax.tree.leaves(tree)
  if not is_sharded(dims):
    return optax.tree.norm(tree)
  if len(jax.tree.leaves(dims)) != len(leaves):
    raise ValueError(
      f"config.fsdp: clip_by_global_norm was given {len(leaves)} leaves of a particle sharded in "
      f"{len(jax.tree.leaves(dims))}: it must see the whole update (first in the chain, not under optax.masked "
      "or multi_transform), or set fsdp=False"
    )
  return jnp.sqrt(sum_over_shards([jnp.sum(jnp.square(x)) for x in leaves], dims))

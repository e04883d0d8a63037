"""Flax NNX modules behind the ``init`` / ``apply`` that a ``Task`` calls (DESIGN.md "Library use").

An NNX module owns its state; the particle state is a pytree with a leading particle axis. So the
module is split once into its graph definition and abstract state, and every call merges a
particle's arrays back into a fresh module:

  nnx.Param      -> variables["params"]        (trained, moved, fused like any Linen parameter)
  nnx.BatchStat  -> variables["batch_stats"]   (updated in train mode, synchronised as the module says)
  nnx.RngState   -> made at every call          (each stream keyed from the step's per-particle key)

Train mode is the module's ``train()`` (``deterministic=False``, ``use_running_average=False``),
eval mode its ``eval()``; the module is called as ``module(inputs)``.

Two ways to give one:
  - an instance, ``MyModel(..., rngs=nnx.Rngs(0))``: every particle starts from its values (config.init
    must be ``shared``, the ipf default);
  - a constructor, ``lambda rngs: MyModel(..., rngs=rngs)``: each particle is built from its own key,
    as a deep ensemble (``init=independent``) needs.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx


def is_nnx(model) -> bool:
  """An NNX module instance, or a constructor ``rngs -> nnx.Module`` (any callable that is not Linen's)."""
  return isinstance(model, nnx.Module) or (callable(model) and not isinstance(model, nn.Module))


def _str_keys(tree):
  """A pure dict with string keys (NNX keys list items by int; Linen, orbax and path patterns use str)."""
  return {str(k): _str_keys(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


def _keys_like(template, tree):
  """``tree`` (string keys) with the keys of ``template`` (NNX's pure dict)."""
  if isinstance(template, dict):
    return {k: _keys_like(v, tree[str(k)]) for k, v in template.items()}
  return tree


def _pure(state) -> dict:
  return _str_keys(nnx.to_pure_dict(state))


class NNXModel:
  """Linen's ``init(rngs, x, train=...)`` / ``apply(variables, x, train=..., rngs=..., mutable=...)`` over
  an NNX module or constructor (see the module docstring)."""

  def __init__(self, model: Union[nnx.Module, Callable[[nnx.Rngs], nnx.Module]]):
    self.instance = model if isinstance(model, nnx.Module) else None
    self.constructor = None if self.instance is not None else model
    abstract = model if self.instance is not None else nnx.eval_shape(lambda: model(nnx.Rngs(0)))
    if not isinstance(abstract, nnx.Module):
      raise TypeError(
        f"Task.model: {model!r} is neither a Flax Linen module, an nnx.Module, nor a constructor "
        f"rngs -> nnx.Module (it returned {type(abstract).__name__})"
      )
    self.graphdef, params, stats, rng_state, rest = nnx.split(abstract, nnx.Param, nnx.BatchStat, nnx.RngState, ...)
    leftover = sorted({type(v).__name__ for _, v in nnx.to_flat_state(rest)})
    if leftover:
      raise TypeError(
        f"the NNX module holds variables of type {', '.join(leftover)}; ipf_jax trains nnx.Param, "
        "nnx.BatchStat and RNG streams (nnx.Rngs). Make the others Params or BatchStats, or "
        "wrap the module with nnx.bridge.to_linen."
      )
    self._abstract = {"params": jax.tree.map(lambda x: x, params), "batch_stats": stats, "rngs": rng_state}
    self._templates = {name: nnx.to_pure_dict(s) for name, s in self._abstract.items()}
    self._rng_leaves = [(tuple(path), v) for path, v in nnx.to_flat_state(rng_state)]  # (path, RngKey | RngCount)

  @property
  def shared_init_only(self) -> bool:
    """An instance gives every particle the same starting values (it cannot be re-initialised)."""
    return self.instance is not None

  @property
  def streams(self) -> tuple:
    """The RNG streams the module holds (``nnx.Rngs`` given to its layers), e.g. ``("dropout",)``."""
    return tuple(sorted({v.tag for _, v in self._rng_leaves}))

  # ---- Linen's interface ----------------------------------------------------------------------------
  def init(self, rngs: dict, x, train: bool = False) -> dict:
    """``{"params": ..., "batch_stats": ...}`` (string keys) of a new module (``rngs["params"]``
    keys every stream of the constructor's ``nnx.Rngs``), or of the instance."""
    del x, train  # NNX modules are built eagerly: their shapes do not come from an example
    if self.instance is not None:
      module = self.instance
    else:
      module = self.constructor(
        nnx.Rngs(rngs["params"], **{k: v for k, v in rngs.items() if k not in ("params", "default")})
      )
    _, params, stats, _ = nnx.split(module, nnx.Param, nnx.BatchStat, nnx.RngState)
    variables = {"params": _pure(params)}
    if self._templates["batch_stats"]:
      variables["batch_stats"] = _pure(stats)
    return variables

  def apply(self, variables: dict, x, train: bool = False, rngs: Optional[dict] = None, mutable=()):
    """The module's output on ``x``; with ``mutable`` (train mode) also ``{"batch_stats": new}``."""
    module = self.module(variables, rngs)
    module.train() if train else module.eval()
    outputs = module(x)
    if not mutable:
      return outputs
    return outputs, ({"batch_stats": _pure(nnx.state(module, nnx.BatchStat))} if self._templates["batch_stats"] else {})

  # ---- NNX's interface ------------------------------------------------------------------------------
  def module(self, variables: dict, rngs: Optional[dict] = None) -> nnx.Module:
    """A module holding ``variables`` (``params``, ``batch_stats``), in eval mode unless set otherwise; its
    RNG streams keyed from ``rngs`` (stream name -> key; a stream not named: from the first key)."""
    states = [self._state("params", variables["params"])]
    if self._templates["batch_stats"]:
      states.append(self._state("batch_stats", variables["batch_stats"]))
    if self._rng_leaves:
      states.append(self._rng_state(rngs))
    module = nnx.merge(self.graphdef, *states)
    module.eval()
    return module

  def _state(self, name: str, tree: dict):
    state = jax.tree.map(lambda x: x, self._abstract[name])  # a copy whose leaves are replaced
    nnx.replace_by_pure_dict(state, _keys_like(self._templates[name], tree))
    return state

  def _rng_state(self, rngs: Optional[dict]):
    """Fresh RNG variables. Each layer's stream variable gets its own key, ``fold_in(k, n)`` of its stream's
    key ``k`` = ``rngs[stream]`` (a stream not named: ``fold_in`` of the first key by the stream's index;
    without keys, a fixed key: eval mode draws nothing) and ``n`` its position; counts start at zero."""
    base = next(iter(rngs.values())) if rngs else jax.random.PRNGKey(0)
    streams = self.streams
    flat = []
    for n, (path, var) in enumerate(self._rng_leaves):
      if jnp.issubdtype(var.dtype, jax.dtypes.prng_key):
        stream = var.tag
        key = rngs[stream] if rngs and stream in rngs else jax.random.fold_in(base, streams.index(stream))
        if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
          key = jax.random.wrap_key_data(key)
        flat.append((path, jnp.broadcast_to(jax.random.fold_in(key, n), var.shape)))  # two layers, two masks
      else:
        flat.append((path, jnp.zeros(var.shape, var.dtype)))
    state = jax.tree.map(lambda x: x, self._abstract["rngs"])
    nnx.replace_by_pure_dict(state, _nest(flat))
    return state


def _nest(flat) -> dict:
  out: dict[Any, Any] = {}
  for path, leaf in flat:
    d = out
    for k in path[:-1]:
      d = d.setdefault(k, {})
    d[path[-1]] = leaf
  return out

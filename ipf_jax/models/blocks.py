"""A model's repeated blocks (a ViT's encoder blocks, a ResNet's residual blocks): recomputed in the backward
pass with ``remat``, and handed their whole parameters when they run while the train step shards its
particles over ``"data"`` (``config.fsdp``, DESIGN.md §2).

The train step gathers a sharded particle's leaves outside its blocks up front and installs a gather
(``gathering``) that each block built by ``make`` calls on its own parameters as it runs. Under ``remat`` the
gather is part of the recomputed block: the forward pass gathers one block, uses it and drops it, the backward
pass gathers it again to recompute the block, and the gather's transpose (a reduce-scatter) hands back that
block's gradient as a device's share at once: the program asks for no more than one block whole at a time
in the train step (evaluation and fusion gather whole particles); whether a compiler keeps it so is
measured in BENCHMARKS.md "Gathering block by block under remat" (XLA:CPU: not). Without ``remat`` each block's gathered
parameters are kept for the backward pass, as the whole particle's are when the step gathers it up front.

A model declares its blocks to the step by ``BLOCKS``, a regex of their ``/``-joined module paths (the ViT's
``Transformer/encoderblock_\\d+``); a ``Task`` takes it from the model (``Task.blocks``).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Optional

import flax.linen as nn

Gather = Callable[[tuple, Any, bool], Any]  # (the block's path of module names, its parameters, remat) -> whole ones
_GATHER: contextvars.ContextVar[Optional[Gather]] = contextvars.ContextVar("ipf_jax_block_gather", default=None)


@contextlib.contextmanager
def gathering(gather: Gather):
  """While the train step traces a particle's forward pass: ``gather(path, params, remat)`` gives the whole
  parameters of the block at ``path`` (recomputed in the backward pass when ``remat``) from a device's
  share of them."""
  token = _GATHER.set(gather)
  try:
    yield
  finally:
    _GATHER.reset(token)


def make(parent: nn.Module, cls: type, name: str, remat: bool, static_argnums: tuple = ()) -> type:
  """The module class of ``parent``'s block ``name`` (construct it with ``name=name``): ``cls`` whose
  parameters go through the installed gather when it runs (``gathering``; none installed: as they are),
  recomputed in the backward pass when ``remat`` (``static_argnums`` as ``nn.remat``'s, ``self`` being 0)."""
  path = tuple(parent.path) + (name,)

  def view(variables):
    gather = _GATHER.get()
    if gather is None or "params" not in variables:
      return variables
    return {**variables, "params": gather(path, variables["params"], remat)}

  block = nn.map_variables(cls, "params", trans_in_fn=view, init=parent.is_initializing())
  return nn.remat(block, static_argnums=static_argnums) if remat else block

"""A model's repeated blocks (a ViT's encoder blocks, a ResNet's residual blocks): recomputed in the backward
pass with ``remat``, and handed their whole parameters when they run while the train step shards its
particles over ``"data"`` (``config.fsdp``, DESIGN.md §2).

The train step gathers a sharded particle's leaves outside its blocks up front and installs a gather
(``gathering``) that each block built by ``make`` calls on its own parameters as it runs. Under ``remat`` the
gather is part of the recomputed block: the forward pass gathers one block, uses it and drops it, the backward
pass gathers it again to recompute the block, and the gather's transpose (a reduce-scatter) hands back that
block's gradient as a device's share at once: the program asks for no more than one block whole at a time
in the train step (evaluation and fusion gather whole particles). Whether a compiler keeps it so is
measured in BENCHMARKS.md "Gathering block by block under remat": XLA:CPU does for blocks run as one
``nn.scan`` (``make(..., scanned=True)``, the ViT's ``scan``: each iteration gathers its slice of the stacked
parameters), and not for unrolled blocks, whose recomputations it schedules together. Without ``remat`` each
block's gathered parameters are kept for the backward pass, as the whole particle's are when the step gathers
it up front.

A model declares its blocks to the step by ``BLOCKS``, a regex of their ``/``-joined module paths (the ViT's
``Transformer/encoderblock(_\\d+)?``: each unrolled block, or the scanned stack); a ``Task`` takes it from the
model (``Task.blocks``).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Optional

import flax.linen as nn

# (the block's path of module names, its parameters, remat, stacked: how many leading axes of a leaf the block's
# own parameters lack, 1 in the body of nn.scan) -> whole ones
Gather = Callable[[tuple, Any, bool, int], Any]
_GATHER: contextvars.ContextVar[Optional[Gather]] = contextvars.ContextVar("ipf_jax_block_gather", default=None)


@contextlib.contextmanager
def gathering(gather: Gather):
  """While the train step traces a particle's forward pass: ``gather(path, params, remat, stacked)`` gives the
  whole parameters of the block at ``path`` (recomputed in the backward pass when ``remat``) from a device's
  share of them (``stacked``: 1 when the block is the body of ``nn.scan``, whose parameters are one slice of
  the stacked leaves)."""
  token = _GATHER.set(gather)
  try:
    yield
  finally:
    _GATHER.reset(token)


def make(
  parent: nn.Module, cls: type, name: str, remat: bool, static_argnums: tuple = (), scanned: bool = False
) -> type:
  """The module class of ``parent``'s block ``name`` (construct it with ``name=name``): ``cls`` whose
  parameters go through the installed gather when it runs (``gathering``; none installed: as they are),
  recomputed in the backward pass when ``remat`` (``static_argnums`` as ``nn.remat``'s, ``self`` being 0).
  ``scanned``: the class is the body of an ``nn.scan`` (``variable_axes={"params": 0}``) named ``name``, so
  each iteration gathers its own slice of the stacked parameters (and under ``remat`` the backward pass
  gathers it again, one block at a time); ``prevent_cse`` is off there, as ``nn.scan`` makes it needless."""
  path = tuple(parent.path) + (name,)

  def view(variables):
    gather = _GATHER.get()
    if gather is None or "params" not in variables:
      return variables
    return {**variables, "params": gather(path, variables["params"], remat, int(scanned))}

  block = nn.map_variables(cls, "params", trans_in_fn=view, init=parent.is_initializing())
  if not remat:
    return block
  return nn.remat(block, static_argnums=static_argnums, prevent_cse=not scanned)

"""The particle exchange: ``new[n] = old[src[n]]`` for every per-particle leaf, across the devices of the
particle axis (DESIGN.md §4).

Three exchanges of one signature (``Exchange``), chosen by ``resample_exchange``: ``all_to_all`` (one
collective per leaf, buffers of ``P`` particles), ``rounds`` (one ``lax.while_loop`` over the rounds a
resampling needs, each one ``ppermute`` shift of a few packed buckets; the default) and ``ragged`` (one
``lax.ragged_all_to_all`` per leaf, GPU/TPU). All run inside ``shard_map`` on the local ``[L]`` block of the
particle axis; ``src`` comes from ``particle_filter.sources``.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


EXCHANGES = ("all_to_all", "rounds", "ragged")


def choose_exchange(method: str) -> str:
  """``auto``: ``rounds`` (peak memory 0.93-1.00x a step without resampling at every measured ``Dp`` up to
  64, where ``all_to_all``'s grows with ``Dp``, to 30x; traffic for the replaced particles only; faster
  when resampling every step on 8 CPU devices: BENCHMARKS.md "Scaling"); otherwise ``method``."""
  return "rounds" if method == "auto" else method


# An exchange: ``exchange(tree, src, axis_name, axis_size) -> tree`` with ``new[n] = old[src[n]]`` for every
# per-particle leaf, across devices, inside ``shard_map`` (``exchange_all_to_all``, ``exchange_rounds``, or
# your own of this signature: ``make_train_step(..., exchange=...)``).
Exchange = Callable[[Any, jax.Array, str, int], Any]


def exchange_fn(method: str) -> Exchange:
  """The exchange named by ``resample_exchange``: ``all_to_all``, ``rounds``, ``ragged`` (GPU/TPU) or ``auto``
  (``choose_exchange``)."""
  return {"all_to_all": exchange_all_to_all, "rounds": exchange_rounds, "ragged": exchange_ragged}[
    choose_exchange(method)
  ]


def exchange(tree, src, axis_name: str, axis_size: int, method: str = "all_to_all"):
  """``exchange_fn(method)(tree, src, axis_name, axis_size)``: all three are exact copies. ``rounds`` and
  ``ragged`` need ``src`` from ``particle_filter.sources`` or a placement of it (every source keeps its own slot,
  ``src[src[n]] == src[n]``); ``all_to_all`` takes any ``src``."""
  return exchange_fn(method)(tree, src, axis_name, axis_size)


def exchange_all_to_all(tree, src, axis_name: str, axis_size: int):
  """``new[n] = old[src[n]]`` for every per-particle leaf, across devices.

  Runs inside ``shard_map``: each leaf is the local block ``[L, ...]`` of the
  particle axis, ``src`` the global ``[P]`` source vector (identical on every
  device). Each device sends, for every destination slot, the local particle
  that slot would take from it (``all_to_all`` over ``axis_name``), then picks
  from the received blocks the one whose device owns the source. A slot whose
  source is itself receives its own particle back, so survivors stay put.

  The send/receive buffers hold ``axis_size * L = P`` particles per leaf per
  device: static shapes, whatever the ancestors; every resampling moves them all.
  On one device it is a gather.
  """
  if not jax.tree.leaves(tree):
    return tree
  if axis_size == 1:
    return jax.tree.map(lambda x: x[src], tree)
  num_local = jax.tree.leaves(tree)[0].shape[0]
  src = src.reshape(axis_size, num_local)
  src_dev, src_loc = src // num_local, src % num_local
  me = lax.axis_index(axis_name)
  my_src_dev = lax.dynamic_index_in_dim(src_dev, me, keepdims=False)  # [L]
  slots = jnp.arange(num_local)

  def move(x):
    send = x[src_loc]  # [Dp, L, ...]: row e = what device e's slots take from me
    recv = lax.all_to_all(send, axis_name, 0, 0)  # recv[d] = device d's row for me
    return recv[my_src_dev, slots]

  return jax.tree.map(move, tree)


def active_rounds(src, num_local: int, axis_size: int):
  """``[Dp, L]`` bool, replicated: round ``(k, j)`` is needed when some device's slot ``j`` takes a particle
  held by the device ``k`` places before it (``k = 0``: a copy within a device)."""
  slots = jnp.arange(src.shape[0])
  moved = src != slots
  shift = (slots // num_local - src // num_local) % axis_size
  need = jnp.zeros((axis_size, num_local), jnp.int32).at[shift, slots % num_local].max(moved.astype(jnp.int32))
  return need > 0


def count_rounds(src, num_local: int):
  """``(across, within)``: how many rounds ``exchange_rounds`` runs for ``src`` across devices (``k > 0``, each
  sends one particle from every device) and within one (``k = 0``, a local copy); int32 scalars."""
  need = active_rounds(src, num_local, src.shape[0] // num_local)
  return jnp.sum(need[1:], dtype=jnp.int32), jnp.sum(need[0], dtype=jnp.int32)


BUCKET_BYTES = 4 << 20


def _particle_bytes(x) -> int:
  """Bytes of one particle's slice of a ``[L, ...]`` leaf."""
  return math.prod(x.shape[1:]) * x.dtype.itemsize


def _varying_axes(x) -> frozenset:
  """The mesh axes a leaf varies over inside ``shard_map`` (its type's manual axes; empty outside): a block
  of a particle sharded over ``"data"`` (``config.fsdp``) varies over it, a whole leaf does not."""
  manual = getattr(jax.typeof(x), "manual_axis_type", None)
  return frozenset(getattr(manual, "varying", ()))


def buckets(leaves, limit: int = BUCKET_BYTES) -> list[list[int]]:
  """Leaf indices grouped for one collective each: same dtype and the same varying mesh axes (blocks and
  whole leaves apart), in order, one particle's slices adding up to at most ``limit`` bytes (a larger leaf
  goes alone), like DDP's gradient buckets."""
  groups, current = [], {}  # current[dtype, axes] = [indices, bytes] of the kind's open bucket
  for i, x in enumerate(leaves):
    nbytes = _particle_bytes(x)
    if nbytes > limit:  # alone; the kind's open bucket stays open for the small leaves after it
      groups.append([i])
      continue
    kind = (x.dtype, _varying_axes(x))
    bucket = current.get(kind)
    if bucket is None or bucket[1] + nbytes > limit:
      bucket = current[kind] = [[], 0]
      groups.append(bucket[0])
    bucket[0].append(i)
    bucket[1] += nbytes
  return groups


def _put_slot(o, j, value, take):
  """Slot ``j`` of ``o`` becomes ``value`` where ``take`` (this device's own decision), in place. A local
  ``cond``, not a ``where`` on the slot: inside the rounds' loop the ``where`` raised the peak (the digits CNN at
  L = 2: 1.15x a step without resampling, against 0.96x; ResNet-18 at L = 2: 1.02x against 0.93x)."""
  return lax.cond(take, lambda o, v: lax.dynamic_update_index_in_dim(o, v, j, 0), lambda o, v: o, o, value)


def _pack(values: list, groups: list) -> list:
  """One particle's leaves as one flat buffer per bucket (``groups``, from ``buckets``; a bucket of one leaf
  keeps its shape)."""
  return [values[g[0]] if len(g) == 1 else jnp.concatenate([values[i].ravel() for i in g]) for g in groups]


def _unpack(packed: list, groups: list, like: list) -> list:
  """``_pack``'s inverse: the leaves, shaped as ``like``."""
  out = [None] * len(like)
  for flat, group in zip(packed, groups):
    offsets = np.cumsum([0] + [like[i].size for i in group])
    for i, a, b in zip(group, offsets[:-1], offsets[1:]):
      out[i] = flat if len(group) == 1 else flat[a:b].reshape(like[i].shape)
  return out


def _shifts(axis_name: str, axis_size: int) -> list:
  """``[shift_0, ..., shift_{Dp-1}]``: ``shift_k(buffers)`` sends them to the device ``k`` places on (one
  static ``ppermute`` each; ``shift_0`` keeps them): the branches of one ``lax.switch``."""

  def shift(k, buffers):
    perm = [(d, (d + k) % axis_size) for d in range(axis_size)]
    return buffers if k == 0 else [lax.ppermute(x, axis_name, perm) for x in buffers]

  return [functools.partial(shift, k) for k in range(axis_size)]


def exchange_rounds(tree, src, axis_name: str, axis_size: int, bucket_bytes: Optional[int] = None):
  """``new[n] = old[src[n]]`` by rounds of one particle: memory and traffic for what moves.

  Needs ``src`` from ``particle_filter.sources`` or a placement of it (every source is a survivor in its own slot,
  ``src[src[n]] == src[n]``): slots that receive are never read afterwards, so the rounds update the
  state in place, in any order.

  Pseudo-code (``active_rounds`` and the loop are replicated: every device runs the same rounds)::

    for (k, j) in the rounds a resampling needs:       # one lax.while_loop
      each device d sends to d + k the particle that slot j of d + k takes from it   # lax.switch over k
      slot j of d + k keeps it if it takes from d                                      # of static ppermutes

  Round ``(k, j)``, ``k = 0 .. Dp-1``, ``j < L``: ``k = 0`` is a copy within a device. A round sends its
  particle in ``buckets`` of at most ``bucket_bytes`` (unless given: a quarter of a particle, at most
  ``BUCKET_BYTES``), one ``ppermute`` each, not one per leaf: a collective's latency is paid per bucket, and
  a bucket near a whole particle raised the digits CNN's peak by 1.4x (BENCHMARKS.md "Scaling").
  The program holds one round (a ``lax.switch`` of ``Dp`` branches, one ``ppermute`` per bucket each)
  whatever ``L`` and the rounds run: its size grows with ``Dp x buckets``, not ``Dp x L x leaves``.
  Per device: buffers of at most one particle, whatever ``Dp`` and ``L``; a resampling that replaces
  ``K`` particles runs at most ``K`` rounds across devices (plus its copies within a device), each sending
  one particle per device; survivors never move. ``exchange_all_to_all`` takes any ``src``.
  """
  leaves, treedef = jax.tree.flatten(tree)
  if not leaves:
    return tree
  num_local = leaves[0].shape[0]
  me = lax.axis_index(axis_name)
  src_dev = (src // num_local).reshape(axis_size, num_local)
  src_loc = (src % num_local).reshape(axis_size, num_local)
  mine_dev = lax.dynamic_index_in_dim(src_dev, me, keepdims=False)  # [L] device each of my slots takes from
  active = active_rounds(src, num_local, axis_size).ravel()  # round k * L + j
  order = jnp.nonzero(active, size=active.size, fill_value=0)[0].astype(jnp.int32)  # the needed rounds first
  if bucket_bytes is None:
    bucket_bytes = min(BUCKET_BYTES, sum(map(_particle_bytes, leaves)) // 4)
  groups = buckets(leaves, bucket_bytes)
  shifts = _shifts(axis_name, axis_size)
  one = lambda o, i: lax.dynamic_index_in_dim(o, i, keepdims=False)

  def round_(carry):
    i, out = carry
    k, j = order[i] // num_local, order[i] % num_local
    dest, sender = (me + k) % axis_size, (me - k) % axis_size
    wanted = one(one(src_loc, dest), j)  # mine that slot j of dest takes (if it takes from me)
    values = [one(o, wanted) for o in out]
    received = _unpack(lax.switch(k, shifts, _pack(values, groups)), groups, values)
    take = one(mine_dev, j) == sender
    return i + 1, [_put_slot(o, j, v, take) for o, v in zip(out, received)]

  count = jnp.sum(active)  # rounds to run, replicated
  _, out = lax.while_loop(lambda carry: carry[0] < count, round_, (jnp.int32(0), leaves))
  return jax.tree.unflatten(treedef, out)


def ragged_plan(src, me, num_local: int, axis_size: int):
  """Device ``me``'s arguments of ``lax.ragged_all_to_all`` for ``new[n] = old[src[n]]``, one slice per
  destination slot: slice ``e * L + j`` is slot ``j`` of device ``e``.

  Returns ``(input_offsets, send_sizes, output_offsets, recv_sizes)``, each ``[P]`` int32:
  ``send_sizes[e L + j] = 1`` when that slot moves and takes particle ``input_offsets[e L + j]`` of mine, written
  on ``e`` at row ``output_offsets[e L + j] = j``; ``recv_sizes[s L + j] = 1`` when my slot ``j`` moves and takes
  from device ``s``. So ``send_sizes`` of every device is ``all_to_all(recv_sizes)`` of the others, as the
  collective requires; a slot that keeps its particle (a survivor) sends and receives nothing.
  """
  slots = jnp.arange(src.shape[0], dtype=jnp.int32)
  src = src.astype(jnp.int32)
  moved = src != slots
  send = moved & (src // num_local == me)
  mine = lax.dynamic_slice_in_dim(src, me * num_local, num_local)  # my slots' sources
  mine_moved = lax.dynamic_slice_in_dim(moved, me * num_local, num_local)
  senders = jnp.arange(axis_size, dtype=jnp.int32)[:, None]
  recv = (mine[None, :] // num_local == senders) & mine_moved[None, :]  # [Dp, L]: from s into my slot j
  return (
    jnp.where(send, src % num_local, 0),
    send.astype(jnp.int32),
    slots % num_local,
    recv.reshape(-1).astype(jnp.int32),
  )


def exchange_ragged(tree, src, axis_name: str, axis_size: int):
  """``new[n] = old[src[n]]`` with one ``lax.ragged_all_to_all`` per leaf (``ragged_plan``): each moved slot
  receives its particle straight into the leaf, survivors never move, no buffer beyond the leaves, and a
  program whose size does not depend on ``Dp`` or ``L``. Needs ``src`` from ``particle_filter.sources`` (or a placement)
  (receiving slots are never sources). For GPUs and TPUs: XLA:CPU does not implement ``ragged-all-to-all``
  (jaxlib 0.10-0.12), so it is tested here by its plan against a numpy simulation of the collective and by
  its lowering, not run.
  """
  leaves, treedef = jax.tree.flatten(tree)
  if not leaves:
    return tree
  plan = ragged_plan(src, lax.axis_index(axis_name), leaves[0].shape[0], axis_size)
  out = [lax.ragged_all_to_all(x, x, *plan, axis_name=axis_name) for x in leaves]
  return jax.tree.unflatten(treedef, out)

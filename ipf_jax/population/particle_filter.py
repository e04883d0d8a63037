"""Importance weights, ESS, systematic resampling and the particle exchange.

Pure functions. The weight math works on all ``P`` particles' values, which the
train step gathers once per step (``gather_all``); ``exchange`` and
``gather_all`` run inside ``shard_map`` on the local ``[L]`` block of the
particle axis and communicate over the named mesh axis.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ipf_jax.population.streams import Stream, stream


def update_log_weights(log_w, loss, alive, temperature: float, forgetting: float):
  """``log w_i <- rho * log w_i - tau * loss_i``; ``-inf`` where not ``alive``.

  Args:
    log_w: ``[L]`` normalised log-weights from the previous step.
    loss: ``[L]`` per-particle training loss of this step.
    alive: ``[L]`` bool, False for a particle whose loss or gradient is not finite.
  Returns:
    ``[L]`` unnormalised log-weights.
  """
  new = forgetting * log_w - temperature * jnp.where(alive, loss, 0.0)
  return jnp.where(alive, new, -jnp.inf)


def logsumexp(log_w):
  """``log sum_i exp(log_w_i)`` over the last axis; ``-inf`` where all are ``-inf``."""
  m = jnp.max(log_w, axis=-1, keepdims=True)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)  # all -inf: avoid (-inf) - (-inf)
  return (m_safe + jnp.log(jnp.sum(jnp.exp(log_w - m_safe), axis=-1, keepdims=True)))[..., 0]


def normalize(log_w, islands: int = 1):
  """``log_w - logsumexp(log_w)`` over all ``P`` particles, so that ``sum_i w_i = 1``.

  With ``islands = G``: over each island (``G`` consecutive groups of ``P / G`` particles), then
  ``- log G_alive``: every island that has a finite weight holds the same share of the total, ``1 /
  G_alive``. An island whose particles are all ``-inf`` is returned unchanged (resampling refills it;
  if every particle is ``-inf`` the step sees ``num_alive == 0`` and skips the update).
  """
  rows = log_w.reshape(islands, -1)
  lse = logsumexp(rows)[:, None]
  alive = jnp.isfinite(lse)
  share = jnp.log(jnp.maximum(jnp.sum(alive), 1).astype(log_w.dtype))  # log 1 = 0 for one island
  return jnp.where(alive, rows - lse - share, rows).reshape(log_w.shape)


def island_ess(log_w, islands: int):
  """``[G]``: each island's own ESS, ``(sum w)^2 / sum w^2`` over its particles (NaN for an island with no
  finite weight)."""
  rows = log_w.reshape(islands, -1)
  return jnp.exp(2.0 * logsumexp(rows) - logsumexp(2.0 * rows))


def ess(log_w, islands: int = 1, dead: float = 0.0):
  """Effective sample size ``1 / sum_i w_i^2`` of normalised log-weights ``[P]``.

  With ``islands = G``: ``G`` times the smallest island's own ESS (``island_ess``; an island with no
  finite weight counts as ``dead``: ``0`` for the resampling decision, which must refill it), so that
  ``ess < threshold * P`` says that some island's ESS is below ``threshold * P / G``. ``G = 1``: the
  plain ESS.
  """
  if islands == 1:
    return jnp.exp(-logsumexp(2.0 * log_w))
  own = island_ess(log_w, islands)
  return islands * jnp.min(jnp.where(jnp.isfinite(own), own, dead))


def adaptive_temperature(
  previous,
  loss,
  alive,
  max_temperature: float,
  forgetting: float,
  target_ess: float,
  iterations: int = 30,
  islands: int = 1,
):
  """The largest ``tau`` in ``[0, max_temperature]`` with ``ess(normalize(rho prev - tau loss)) >= target_ess``
  (bisection over ``iterations`` halvings, replicated: all arguments are the ``[P]`` values of every
  particle); ``max_temperature`` when that already keeps the ESS, ``0`` when nothing does.

  Args:
    previous: ``[P]`` normalised log-weights before this step.
    loss: ``[P]`` this step's losses; ``alive``: ``[P]`` bool.
    target_ess: in particles (``ess_target * P``); ``islands``: as in ``ess``, over the islands that have a
      finite weight (an island with none has no ESS for ``tau`` to keep).
  """

  def ess_at(tau):  # an island without weight has no ESS to keep: it counts as infinite
    return ess(normalize(update_log_weights(previous, loss, alive, tau, forgetting), islands), islands, jnp.inf)

  def halve(_, bounds):
    lo, hi = bounds
    mid = 0.5 * (lo + hi)
    good = ess_at(mid) >= target_ess
    return jnp.where(good, mid, lo), jnp.where(good, hi, mid)

  zero = jnp.zeros((), loss.dtype)
  lo, _ = lax.fori_loop(0, iterations, halve, (zero, zero + max_temperature))
  return jnp.where(ess_at(zero + max_temperature) >= target_ess, zero + max_temperature, lo)


def gather_all(x, axis_name: str):
  """All particles' ``[P]`` values from each device's ``[L]`` block, typed as
  identical on every device (``all_gather`` is typed device-varying, which
  ``lax.cond`` would reject): a scatter into zeros, then ``psum``."""
  num_local = x.shape[0]
  full = jnp.zeros((num_local * lax.axis_size(axis_name),) + x.shape[1:], x.dtype)
  full = lax.dynamic_update_slice_in_dim(full, x, lax.axis_index(axis_name) * num_local, axis=0)
  return lax.psum(full, axis_name)


def systematic_resample(u, log_w):
  """Systematic resampling of ``P`` particles with one shared uniform ``u``.

  ``a_n = min(searchsorted(c, (n + u) / P, side="right"), last)`` for
  ``n = 0..P-1``, with ``c = cumsum(w) / sum(w)`` and ``last`` the highest
  index with ``w > 0`` (so a culled particle is never an ancestor, even when
  rounding leaves ``c[-1]`` short of 1). The result is ascending and particle
  ``i`` gets ``floor(P w_i)`` or ``floor(P w_i) + 1`` copies.

  Args:
    u: scalar in ``[0, 1)``.
    log_w: ``[P]`` log-weights of all particles (normalised or not).
  Returns:
    ``[P]`` int32 ancestors.
  """
  num = log_w.shape[0]
  w = jnp.exp(log_w - jnp.max(log_w))
  c = jnp.cumsum(w)
  c = c / c[-1]
  positions = (jnp.arange(num, dtype=c.dtype) + u) / num
  idx = jnp.searchsorted(c, positions, side="right").astype(jnp.int32)
  last = num - 1 - jnp.argmax(w[::-1] > 0).astype(jnp.int32)
  return jnp.minimum(idx, last)


def assign_slots(ancestors):
  """Slot assignment that keeps survivors in place.

  A particle with at least one offspring keeps one copy in its own slot; the
  freed slots (no offspring), in ascending order, receive the extra copies in
  ascending ancestor order.

  Args:
    ancestors: ``[P]`` ascending ancestor indices (from ``systematic_resample``).
  Returns:
    ``[P]`` int32 ``src`` with ``new_particle[n] = old_particle[src[n]]``.
  """
  num = ancestors.shape[0]
  ancestors = ancestors.astype(jnp.int32)
  counts = jnp.bincount(ancestors, length=num)
  first = jnp.concatenate([jnp.ones((1,), bool), ancestors[1:] != ancestors[:-1]])
  extras = ancestors[jnp.argsort(first, stable=True)]  # repeated copies first, in order
  freed = counts == 0
  rank = jnp.cumsum(freed) - 1
  return jnp.where(freed, extras[jnp.clip(rank, 0, num - 1)], jnp.arange(num, dtype=jnp.int32))


def sources(u, log_w, islands: int = 1):
  """``[P]`` int32 ``src`` of a resampling, ``new_particle[n] = old_particle[src[n]]``: each island (``islands``
  consecutive groups of ``n = P / islands``; one island: the whole population) is resampled on its own
  (``systematic_resample`` of its weights with the same ``u``, then ``assign_slots``), so a copy never leaves
  its island and survivors keep their slots. An island with no finite weight takes the resampled particles
  of the next island (cyclically) that has one.
  """
  num = log_w.shape[0]
  n = num // islands
  rows = log_w.reshape(islands, n)
  own = jax.vmap(lambda row: assign_slots(systematic_resample(u, row)))(rows)
  own = own + n * jnp.arange(islands, dtype=jnp.int32)[:, None]
  alive = jnp.isfinite(rows).any(axis=1)
  order = (jnp.arange(islands)[:, None] + jnp.arange(islands)[None, :]) % islands  # row g: g, g + 1, ...
  donor = jnp.take_along_axis(order, jnp.argmax(alive[order], axis=1)[:, None], axis=1)[:, 0]
  return own[donor].reshape(num)


EXCHANGES = ("all_to_all", "rounds", "ragged")


def choose_exchange(method: str) -> str:
  """``auto``: ``rounds`` (peak memory 0.94-1.00x a step without resampling at every measured ``Dp`` up to
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
  """``exchange_fn(method)(tree, src, axis_name, axis_size)``: both are exact copies. ``rounds`` needs
  ``src`` from ``assign_slots`` (every source keeps its own slot, ``src[src[n]] == src[n]``);
  ``all_to_all`` takes any ``src``."""
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

  Needs ``src`` from ``assign_slots`` (every source is a survivor kept in its own slot,
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
  program whose size does not depend on ``Dp`` or ``L``. Needs ``src`` from ``assign_slots`` (receiving slots
  are never sources). For GPUs and TPUs: XLA:CPU does not implement ``ragged-all-to-all`` (jaxlib 0.10-0.12),
  so it is tested here by its plan against a numpy simulation of the collective and by its lowering, not run.
  """
  leaves, treedef = jax.tree.flatten(tree)
  if not leaves:
    return tree
  plan = ragged_plan(src, lax.axis_index(axis_name), leaves[0].shape[0], axis_size)
  out = [lax.ragged_all_to_all(x, x, *plan, axis_name=axis_name) for x in leaves]
  return jax.tree.unflatten(treedef, out)


def jitter(params, src, key, sigma: float, axis_name: str, blocks: Optional[tuple] = None):
  """``theta += sigma * eps`` on the local slots that received a copy (``src[n] != n``).

  Slot ``n``'s noise is one float32 draw ``normal(fold_in(key, n), (its number of weights,))``, cut into the
  leaves in ``jax.tree.flatten`` order: the same on any mesh. One draw, not one per leaf: a per-leaf draw
  compiles one RNG per leaf inside the resampling branch (+6 s per compile of the digits step, measured).
  Slots are drawn one at a time: the temporaries (the random bits, the normals, their pieces) are a few
  particles' weights in float32 (5x, compiled alone for the digits CNN), whatever ``L`` and the mesh.
  Runs inside ``shard_map``; ``params`` leaves are the local ``[L, ...]`` blocks. ``blocks`` = ``(dims,
  axis)`` when some leaves are blocks of a particle sharded over ``axis`` (``fsdp.blocks``: each leaf's sharded
  dimension of its ``[P, ...]`` leaf, or -1): the whole particle's noise is drawn and each device keeps its
  block, so the copies are the same as with whole particles.
  """
  leaves, treedef = jax.tree.flatten(params)
  num_local = leaves[0].shape[0]
  first = lax.axis_index(axis_name) * num_local
  slots = first + jnp.arange(num_local)
  copied = lax.dynamic_slice_in_dim(src, first, num_local) != slots
  dims, block_axis = blocks or ((-1,) * len(leaves), None)
  shapes = [_whole_shape(x.shape[1:], d, block_axis) for x, d in zip(leaves, dims)]
  sizes = [math.prod(shape) for shape in shapes]

  def add_noise(j, out):
    eps = jnp.split(jax.random.normal(jax.random.fold_in(key, slots[j]), (sum(sizes),)), np.cumsum(sizes)[:-1])
    eps = [_block(e.reshape(shape), d, block_axis) for e, shape, d in zip(eps, shapes, dims)]
    return [
      lax.dynamic_update_index_in_dim(
        x, lax.dynamic_index_in_dim(x, j, keepdims=False) + (sigma * e).astype(x.dtype), j, 0
      )
      for x, e in zip(out, eps)
    ]

  # A survivor's slot draws nothing; one loop body (not one cond per slot) keeps the compile time flat in L.
  leaves = lax.fori_loop(
    0, num_local, lambda j, out: lax.cond(copied[j], add_noise, lambda j, out: out, j, out), leaves
  )
  return jax.tree.unflatten(treedef, leaves)


def _whole_shape(shape: tuple, dim: int, axis: Optional[str]) -> tuple:
  """A particle's leaf shape from its block's (``dim``: the block's dimension of the ``[P, ...]`` leaf, -1 whole)."""
  if dim < 0:
    return tuple(shape)
  return tuple(n * lax.axis_size(axis) if i == dim - 1 else n for i, n in enumerate(shape))


def _block(whole, dim: int, axis: Optional[str]):
  """This device's block of a particle's whole leaf (``_whole_shape``'s inverse)."""
  if dim < 0:
    return whole
  size = whole.shape[dim - 1] // lax.axis_size(axis)
  return lax.dynamic_slice_in_dim(whole, lax.axis_index(axis) * size, size, axis=dim - 1)


def resample(
  key,
  particle,
  log_w,
  all_log_w,
  axis_size: int,
  sigma: float = 0.0,
  axis_name: str = "particle",
  exchange: Exchange = exchange_all_to_all,
  islands: int = 1,
  blocks: Optional[tuple] = None,
):
  """Systematic resampling of the whole population (or of each island), survivors in place (DESIGN.md §3.5).

  ``u`` from ``Stream.RESAMPLE``; slot ``n`` takes particle ``sources(u, all_log_w, islands)[n]``
  (``systematic_resample`` then ``assign_slots``, per island; survivors keep their slots, as
  ``exchange_rounds`` requires), moved by ``exchange``;
  copies get ``jitter`` from ``Stream.JITTER`` when ``sigma`` (a float, or a traced scalar) is not
  ``0``; weights reset to ``-log P``.

  Args:
    particle: tuple ``(params, ...)`` of local ``[L, ...]`` trees that move together.
    log_w: ``[L]`` local log-weights; ``all_log_w``: ``[P]`` all of them (replicated).
    blocks: ``jitter``'s, when the parameters are blocks of sharded particles (``fsdp.blocks``).
  Returns:
    ``(particle, uniform log-weights [L], src [P])``.
  """
  u = jax.random.uniform(stream(key, Stream.RESAMPLE))
  src = sources(u, all_log_w, islands)
  params, *rest = exchange(particle, src, axis_name, axis_size)
  if not isinstance(sigma, (int, float)) or sigma:  # a traced sigma (jitter_lr) always applies
    params = jitter(params, src, stream(key, Stream.JITTER), sigma, axis_name, blocks)
  return (params, *rest), jnp.full_like(log_w, -jnp.log(all_log_w.shape[0])), src

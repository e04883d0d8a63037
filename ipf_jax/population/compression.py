"""Compressed weighted consensus: int8 per-block quantisation with error feedback
(DESIGN.md §3.3, seed 000 §4.1).

Inside ``shard_map``, each device holds ``L`` particles. The consensus
``g_bar = sum_j w_j g_j`` is exchanged as

  quantise each particle's ``e_j = w_j g_j + r_j`` (int8, one fp32 scale per block)
  -> ``all_to_all`` (every device receives its 1/Dp chunk from all devices)
  -> reduce in fp32 -> quantise -> ``all_gather`` -> dequantise.

Error feedback: ``r_j <- e_j - dequant(quant(e_j))`` and the second
quantisation's error of a device's chunk is added to its first local
particle's residual, so every rounding error is sent again next step and the
running sum of compressed consensuses stays within one step's residual of the
exact running sum (no drift). Residuals are per particle (``[P, N]``) and move
with their particle when it is resampled.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

BLOCK = 256  # values per fp32 scale: 1 scale per 256 int8 values


def residual_size(num_params: int) -> int:
  """Length of a particle's stored residual: ``num_params`` rounded up to whole blocks
  (independent of the mesh, so checkpoints restore onto other device counts)."""
  return -(-num_params // BLOCK) * BLOCK


def quantize(x):
  """``x [..., n]`` (``n % BLOCK == 0``) -> int8 ``[..., n/BLOCK, BLOCK]`` and fp32 scales ``[..., n/BLOCK]``."""
  xb = x.reshape(x.shape[:-1] + (x.shape[-1] // BLOCK, BLOCK))
  scale = jnp.max(jnp.abs(xb), axis=-1) / 127.0
  safe = jnp.where(scale > 0, scale, 1.0)
  q = jnp.clip(jnp.round(xb / safe[..., None]), -127, 127).astype(jnp.int8)
  return q, scale


def dequantize(q, scale):
  """Inverse of ``quantize`` (up to rounding): ``[..., n/BLOCK, BLOCK] -> [..., n]``."""
  x = q.astype(jnp.float32) * scale[..., None]
  return x.reshape(x.shape[:-2] + (x.shape[-2] * x.shape[-1],))


def flatten(tree, length: int):
  """Per-particle leaves ``[L, ...]`` -> ``[L, length]`` fp32 (zero padded)."""
  leaves = jax.tree.leaves(tree)
  flat = jnp.concatenate([x.reshape(x.shape[0], -1).astype(jnp.float32) for x in leaves], axis=1)
  return jnp.pad(flat, ((0, 0), (0, length - flat.shape[1])))


def unflatten(vector, like):
  """``[length]`` -> a tree shaped like one particle of ``like`` (leaves without the ``[L]`` axis)."""
  leaves, treedef = jax.tree.flatten(like)
  out, start = [], 0
  for x in leaves:
    size = x[0].size
    out.append(vector[start : start + size].reshape(x.shape[1:]).astype(x.dtype))
    start += size
  return jax.tree.unflatten(treedef, out)


def compressed_consensus(grads, weights, residual, axis_name: str, axis_size: int):
  """``(g_bar, new_residual)``: the compressed ``sum_j w_j g_j`` over all particles.

  Args:
    grads: per-particle gradient leaves ``[L, ...]``.
    weights: ``[L]`` normalised weights (0 for a culled particle).
    residual: ``[L, N]`` fp32 error-feedback residuals, ``N = residual_size(...)``.
  Returns:
    ``g_bar`` leaves without the particle axis (identical on every device) and
    the updated ``[L, N]`` residual.
  """
  num_local, stored = residual.shape
  length = -(-stored // (BLOCK * axis_size)) * BLOCK * axis_size  # whole blocks in every device's chunk
  residual = jnp.pad(residual, ((0, 0), (0, length - stored)))
  e = weights[:, None].astype(jnp.float32) * flatten(grads, length) + residual
  q, s = quantize(e)  # [L, nb, B], [L, nb]
  residual = e - dequantize(q, s)
  nb = q.shape[1] // axis_size  # blocks per device chunk
  q_send = q.reshape(num_local, axis_size, nb, BLOCK).transpose(1, 0, 2, 3)  # [Dp, L, nb, B]
  s_send = s.reshape(num_local, axis_size, nb).transpose(1, 0, 2)
  q_recv = lax.all_to_all(q_send, axis_name, 0, 0)  # [Dp(source), L, nb, B]: my chunk from everyone
  s_recv = lax.all_to_all(s_send, axis_name, 0, 0)
  chunk = jnp.sum(q_recv.astype(jnp.float32) * s_recv[..., None], axis=(0, 1)).reshape(nb * BLOCK)
  q2, s2 = quantize(chunk)
  me = lax.axis_index(axis_name)
  error2 = chunk - dequantize(q2, s2)
  residual = residual.at[0].set(
    lax.dynamic_update_slice_in_dim(
      residual[0], lax.dynamic_slice_in_dim(residual[0], me * nb * BLOCK, nb * BLOCK) + error2, me * nb * BLOCK, 0
    )
  )
  q_all = lax.all_gather(q2, axis_name)  # [Dp, nb, B]
  s_all = lax.all_gather(s2, axis_name)
  total = dequantize(q_all, s_all).reshape(-1)
  return unflatten(total, grads), residual[:, :stored]

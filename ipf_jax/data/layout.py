"""Host batches to global device arrays in the per-particle layout (DESIGN.md §2)."""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding

from ipf_jax.step import BATCH_SPEC, EVAL_BATCH_SPEC


def particle_layout(batch: dict, num_particles: int) -> dict:
  """``[G, ...] -> [P, G / P, ...]``: particle ``i`` trains on the ``i``-th shard."""
  return {k: v.reshape((num_particles, v.shape[0] // num_particles) + v.shape[1:]) for k, v in batch.items()}


def put_sharded(batch: dict, specs: dict, mesh: jax.sharding.Mesh) -> dict:
  # From the full host batch, each process materialises only its own shards (multi-host safe).
  return {k: jax.make_array_from_callback(v.shape, NamedSharding(mesh, specs[k]), lambda idx, v=v: v[idx])
          for k, v in batch.items()}


def put_train_batch(batch: dict, num_particles: int, mesh: jax.sharding.Mesh) -> dict:
  """Global ``[P, B, ...]`` arrays sharded ``P("particle", "data")``."""
  return put_sharded(particle_layout(batch, num_particles), BATCH_SPEC, mesh)


def put_eval_batch(batch: dict, mesh: jax.sharding.Mesh) -> dict:
  """Global ``[N, ...]`` arrays sharded over ``"data"``, replicated over ``"particle"``."""
  return put_sharded(batch, EVAL_BATCH_SPEC, mesh)

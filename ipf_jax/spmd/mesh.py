"""The ("particle", "data") device mesh (DESIGN.md §2) and multi-host start-up."""

from __future__ import annotations

import math
from typing import Sequence, Tuple

import jax

PARTICLE = "particle"
DATA = "data"


def mesh_shape(num_particles: int, num_devices: int, particle_axis_size: int = 0) -> Tuple[int, int]:
  """``(Dp, Dd)`` for ``P`` particles on ``D`` devices; ``Dp = gcd(P, D)`` unless given."""
  dp = particle_axis_size or math.gcd(num_particles, num_devices)
  return dp, num_devices // dp


def make_mesh(num_particles: int, devices: Sequence[jax.Device], particle_axis_size: int = 0) -> jax.sharding.Mesh:
  """A mesh of ``devices`` with axes ``("particle", "data")``.

  ``jax.make_mesh`` orders devices for the physical topology; ``"data"`` is the
  minor axis, so a particle's data-parallel group sits on neighbouring devices.
  """
  dp, dd = mesh_shape(num_particles, len(devices), particle_axis_size)
  return jax.make_mesh(
    (dp, dd), (PARTICLE, DATA), axis_types=(jax.sharding.AxisType.Explicit,) * 2, devices=list(devices)
  )


def one_program_at_a_time(x):
  """On the CPU, waits for ``x``: XLA:CPU runs the collectives of several devices on one shared
  thread pool, and with more than one collective program in flight (async dispatch) waiting
  participants can hold every thread, so a rendezvous never completes (seen here as
  "Termination timeout for all reduce ... Expected 8 threads"). GPUs and TPUs keep async dispatch."""
  if jax.default_backend() == "cpu" and jax.device_count() > 1:
    jax.block_until_ready(x)
  return x

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
  return jax.make_mesh((dp, dd), (PARTICLE, DATA), axis_types=(jax.sharding.AxisType.Explicit,) * 2,
                       devices=list(devices))

"""A small convolutional network for low-resolution images (8x8 digits)."""

from __future__ import annotations

from functools import partial
from typing import Any, Optional, Sequence

import flax.linen as nn
import jax.numpy as jnp


class CNN(nn.Module):
  """Conv-BN-ReLU stages, 2x2 average pooling between stages, global mean, dense.

  ``bn_axis_name`` names the mesh axis BatchNorm averages its batch statistics
  over in train mode (``"data"`` = SyncBN inside the particle's group).
  """

  num_classes: int
  features: Sequence[int] = (32, 64, 128)
  dtype: Any = jnp.float32
  bn_momentum: float = 0.9
  bn_axis_name: Optional[str] = None

  @nn.compact
  def __call__(self, x, train: bool):
    norm = partial(
      nn.BatchNorm,
      use_running_average=not train,
      momentum=self.bn_momentum,
      epsilon=1e-5,
      dtype=self.dtype,
      axis_name=self.bn_axis_name,
    )
    x = x.astype(self.dtype)
    for i, f in enumerate(self.features):
      if i > 0:
        x = nn.avg_pool(x, (2, 2), strides=(2, 2), padding="SAME")
      x = nn.Conv(f, (3, 3), use_bias=False, dtype=self.dtype)(x)
      x = nn.relu(norm()(x))
    x = jnp.mean(x, axis=(1, 2))
    x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
    return x.astype(jnp.float32)

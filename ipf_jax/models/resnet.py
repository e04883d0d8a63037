"""ResNet v1.5 family (stride in the 3x3 conv of bottleneck blocks), after flax's imagenet example.

BatchNorm averages its batch statistics over ``bn_axis_name`` in train mode
(``"data"`` = SyncBN inside a particle's device group). Parameters are float32;
``dtype`` sets the compute dtype (bfloat16 on TPUs and recent GPUs).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax.numpy as jnp

from ipf_jax.models import blocks

ModuleDef = Any


class ResNetBlock(nn.Module):
  """Basic block: two 3x3 convs (ResNet-18/34)."""

  filters: int
  conv: ModuleDef
  norm: ModuleDef
  act: Callable
  strides: tuple[int, int] = (1, 1)

  @nn.compact
  def __call__(self, x):
    residual = x
    y = self.act(self.norm()(self.conv(self.filters, (3, 3), self.strides)(x)))
    y = self.norm(scale_init=nn.initializers.zeros_init())(self.conv(self.filters, (3, 3))(y))
    if residual.shape != y.shape:
      residual = self.norm(name="norm_proj")(self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(residual))
    return self.act(residual + y)


class BottleneckResNetBlock(ResNetBlock):
  """Bottleneck block 1x1 -> 3x3 (strided, v1.5) -> 1x1 x4 (ResNet-50/101/152); same fields."""

  @nn.compact
  def __call__(self, x):
    residual = x
    y = self.act(self.norm()(self.conv(self.filters, (1, 1))(x)))
    y = self.act(self.norm()(self.conv(self.filters, (3, 3), self.strides)(y)))
    y = self.norm(scale_init=nn.initializers.zeros_init())(self.conv(self.filters * 4, (1, 1))(y))
    if residual.shape != y.shape:
      residual = self.norm(name="norm_proj")(
        self.conv(self.filters * 4, (1, 1), self.strides, name="conv_proj")(residual)
      )
    return self.act(residual + y)


class ResNet(nn.Module):
  """ResNet with an ImageNet stem (7x7/2 conv + 3x3/2 max-pool) or, with
  ``small_inputs``, a 3x3/1 stem for 32x32 images (CIFAR).

  ``remat`` recomputes each block's activations in the backward pass
  (gradient checkpointing): less memory, about one extra forward of compute.
  """

  BLOCKS = r"stage\d+_block\d+"  # the blocks that gather their own parameters (models.blocks)

  stage_sizes: Sequence[int]
  block_cls: ModuleDef
  num_classes: int
  num_filters: int = 64
  dtype: Any = jnp.float32
  act: Callable = nn.relu
  bn_momentum: float = 0.9
  bn_axis_name: Optional[str] = None
  small_inputs: bool = False
  remat: bool = False

  @nn.compact
  def __call__(self, x, train: bool = True):
    conv = partial(nn.Conv, use_bias=False, dtype=self.dtype)
    norm = partial(
      nn.BatchNorm,
      use_running_average=not train,
      momentum=self.bn_momentum,
      epsilon=1e-5,
      dtype=self.dtype,
      axis_name=self.bn_axis_name,
    )
    x = x.astype(self.dtype)
    if self.small_inputs:
      x = conv(self.num_filters, (3, 3), name="conv_init")(x)
      x = nn.relu(norm(name="bn_init")(x))
    else:
      x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="conv_init")(x)
      x = nn.relu(norm(name="bn_init")(x))
      x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    for i, block_size in enumerate(self.stage_sizes):
      for j in range(block_size):
        strides = (2, 2) if i > 0 and j == 0 else (1, 1)
        name = f"stage{i + 1}_block{j + 1}"
        block = blocks.make(self, self.block_cls, name, self.remat)
        x = block(self.num_filters * 2**i, strides=strides, conv=conv, norm=norm, act=self.act, name=name)(x)
    x = jnp.mean(x, axis=(1, 2))
    x = nn.Dense(self.num_classes, dtype=self.dtype, name="head")(x)
    return x.astype(jnp.float32)


ResNet18 = partial(ResNet, stage_sizes=[2, 2, 2, 2], block_cls=ResNetBlock)
ResNet34 = partial(ResNet, stage_sizes=[3, 4, 6, 3], block_cls=ResNetBlock)
ResNet50 = partial(ResNet, stage_sizes=[3, 4, 6, 3], block_cls=BottleneckResNetBlock)
ResNet101 = partial(ResNet, stage_sizes=[3, 4, 23, 3], block_cls=BottleneckResNetBlock)
ResNet152 = partial(ResNet, stage_sizes=[3, 8, 36, 3], block_cls=BottleneckResNetBlock)
# For tests: two tiny stages of basic blocks.
ResNetTiny = partial(ResNet, stage_sizes=[1, 1], block_cls=ResNetBlock, num_filters=8)

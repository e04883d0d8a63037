"""The plain Vision Transformer (Dosovitskiy et al. 2021), as big_vision's ``models/vit.py`` writes it.

Patches of ``patch_size`` embedded by one strided convolution, a position embedding (learned, or fixed 2-d
sin-cos), an optional class token, ``depth`` pre-LayerNorm encoder blocks (multi-head self-attention, then a
GELU MLP of ``mlp_dim``; dropout after each and stochastic depth on each residual branch), a final
LayerNorm, the pooled representation (``gap``: the mean over tokens; ``tok``: the class token) and a linear
head initialised to zeros. Parameters are float32; ``dtype`` is the compute dtype (bfloat16 on accelerators).
``remat`` recomputes each block in the backward pass. ``scan`` runs the blocks as one ``nn.scan`` (big_vision's
and MaxText's ``scan_layers``): the program holds one block, not ``depth``, so it compiles in a fraction of the
time, and under ``remat`` the backward pass recomputes one block at a time (an unrolled stack leaves the
compiler free to schedule every block's recomputation together; BENCHMARKS.md "Gathering block by block under
remat"). Its parameters are the blocks' stacked, ``Transformer/encoderblock/...`` of ``[depth, ...]``, where
the unrolled model has ``Transformer/encoderblock_{i}/...`` (``stack_blocks`` converts). No BatchNorm: a
particle's statistics are its parameters only.

The sizes are big_vision's ``decode_variant``: Ti, S, B, L, H, g; ``vit_b16`` with a class token and a
learned position embedding has 86,567,656 parameters at 1,000 classes and 224 x 224 images (the original
ViT-B/16; ``tests/test_models.py`` counts them).
"""

from __future__ import annotations

import re
from typing import Optional

import flax.linen as nn
from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from ipf_jax.models import blocks

# name: (width, depth, mlp_dim, heads)
SIZES = {
  "ti": (192, 12, 768, 3),
  "s": (384, 12, 1536, 6),
  "b": (768, 12, 3072, 12),
  "l": (1024, 24, 4096, 16),
  "h": (1280, 32, 5120, 16),
  "g": (1408, 40, 6144, 16),
}
# The zoo's names: size and patch size (``config.vit_patch_size`` overrides the patch, e.g. 4 on 28 x 28).
VARIANTS = {
  "vit_ti16": ("ti", 16),
  "vit_s16": ("s", 16),
  "vit_b16": ("b", 16),
  "vit_l16": ("l", 16),
  "vit_h14": ("h", 14),
  "vit_g14": ("g", 14),
}


def posemb_sincos_2d(h: int, w: int, width: int, temperature: float = 10_000.0, dtype=jnp.float32):
  """The fixed 2-d sin-cos position embedding ``[1, h * w, width]`` (big_vision's, MoCo v3's)."""
  if width % 4:
    raise ValueError(f"a sincos2d position embedding needs a width divisible by 4, got {width}")
  y, x = np.mgrid[:h, :w]
  omega = 1.0 / temperature ** (np.arange(width // 4) / max(width // 4 - 1, 1))
  y = np.einsum("m,d->md", y.flatten(), omega)
  x = np.einsum("m,d->md", x.flatten(), omega)
  return jnp.asarray(np.concatenate([np.sin(x), np.cos(x), np.sin(y), np.cos(y)], axis=1)[None], dtype)


class MlpBlock(nn.Module):
  mlp_dim: int
  dropout: float = 0.0
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x, deterministic: bool = True):
    inits = dict(kernel_init=nn.initializers.xavier_uniform(), bias_init=nn.initializers.normal(stddev=1e-6))
    d = x.shape[-1]
    x = nn.gelu(nn.Dense(self.mlp_dim, dtype=self.dtype, **inits)(x))
    x = nn.Dropout(rate=self.dropout)(x, deterministic)
    return nn.Dense(d, dtype=self.dtype, **inits)(x)


def _drop_path(x, rate, deterministic: bool, module: nn.Module):
  """Stochastic depth: the residual branch ``x`` of a whole example dropped with probability ``rate`` (a
  number, or a traced scalar in a scanned block) (the survivors scaled by ``1 / (1 - rate)``), from the
  ``dropout`` stream."""
  if deterministic or (isinstance(rate, (int, float)) and not rate):
    return x
  keep = jax.random.bernoulli(module.make_rng("dropout"), 1.0 - rate, (x.shape[0],) + (1,) * (x.ndim - 1))
  return jnp.where(keep, x / (1.0 - rate), 0)


class Encoder1DBlock(nn.Module):
  """Pre-LayerNorm block: ``x + attention(LN(x))``, then ``x + MLP(LN(x))``."""

  mlp_dim: int
  num_heads: int
  dropout: float = 0.0
  drop_path: float = 0.0
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x, deterministic: bool = True, rate=None):
    """``rate``: this block's drop rate when it is an input (a scanned block's), else ``drop_path``."""
    rate = self.drop_path if rate is None else rate
    y = nn.LayerNorm(dtype=self.dtype)(x)
    y = nn.MultiHeadDotProductAttention(
      num_heads=self.num_heads,
      kernel_init=nn.initializers.xavier_uniform(),
      deterministic=deterministic,
      dtype=self.dtype,
    )(y, y)
    y = nn.Dropout(rate=self.dropout)(y, deterministic)
    x = x + _drop_path(y, rate, deterministic, self)
    y = nn.LayerNorm(dtype=self.dtype)(x)
    y = MlpBlock(mlp_dim=self.mlp_dim, dropout=self.dropout, dtype=self.dtype)(y, deterministic)
    y = nn.Dropout(rate=self.dropout)(y, deterministic)
    return x + _drop_path(y, rate, deterministic, self)


class ScannedBlock(Encoder1DBlock):
  """The body of ``nn.scan`` over the blocks: ``(x, rate) -> (x, None)``, the block's drop rate an input
  (``drop_path`` > 0 only says that the blocks drop paths at all)."""

  @nn.compact
  def __call__(self, x, rate, deterministic: bool = True):
    return super().__call__(x, deterministic, rate if self.drop_path else None), None


class Encoder(nn.Module):
  """``depth`` blocks, then the final LayerNorm (big_vision's ``Transformer`` scope and names)."""

  depth: int
  mlp_dim: int
  num_heads: int
  dropout: float = 0.0
  stochastic_depth: float = 0.0
  remat: bool = False
  scan: bool = False
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x, deterministic: bool = True):
    rates = [self.stochastic_depth * i / max(self.depth - 1, 1) for i in range(self.depth)]  # block i's drop rate
    if self.scan:
      block = blocks.make(self, ScannedBlock, "encoderblock", self.remat, static_argnums=(3,), scanned=True)
      scanned = nn.scan(
        block,
        variable_axes={"params": 0},
        split_rngs={"params": True, "dropout": True},
        in_axes=(0, nn.broadcast),
        length=self.depth,
      )
      args = (self.mlp_dim, self.num_heads, self.dropout, self.stochastic_depth, self.dtype)
      x, _ = scanned(*args, name="encoderblock")(x, jnp.asarray(rates, jnp.float32), deterministic)
    else:
      for i, rate in enumerate(rates):
        name = f"encoderblock_{i}"
        block = blocks.make(self, Encoder1DBlock, name, self.remat, static_argnums=(2,))
        x = block(self.mlp_dim, self.num_heads, self.dropout, rate, self.dtype, name=name)(x, deterministic)
    return nn.LayerNorm(name="encoder_norm", dtype=self.dtype)(x)


class ViT(nn.Module):
  """``ViT(num_classes, patch_size=16, width=768, depth=12, mlp_dim=3072, num_heads=12)``; ``__call__(images,
  train)`` gives ``[N, num_classes]`` logits (float32)."""

  # the blocks that gather their own parameters (models.blocks): each one, or the scanned stack
  BLOCKS = r"Transformer/encoderblock(_\d+)?"

  num_classes: int
  patch_size: int = 16
  width: int = 768
  depth: int = 12
  mlp_dim: int = 3072
  num_heads: int = 12
  posemb: str = "learn"  # learn | sincos2d
  pool: str = "tok"  # tok (class token) | gap (mean over tokens)
  dropout: float = 0.0
  stochastic_depth: float = 0.0  # the last block's drop rate; block i drops i / (depth - 1) of it
  remat: bool = False
  scan: bool = False  # the blocks as one nn.scan, their parameters stacked (module docstring)
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = jnp.asarray(x, self.dtype)
    p = self.patch_size
    x = nn.Conv(self.width, (p, p), strides=(p, p), padding="VALID", name="embedding", dtype=self.dtype)(x)
    n, h, w, c = x.shape
    x = jnp.reshape(x, (n, h * w, c))
    if self.pool == "tok":
      cls = self.param("cls", nn.initializers.zeros, (1, 1, c))
      x = jnp.concatenate([jnp.tile(cls.astype(x.dtype), (n, 1, 1)), x], axis=1)
    x = x + self._posemb(x.shape[1], h, w, c).astype(x.dtype)
    x = nn.Dropout(rate=self.dropout)(x, not train)
    x = Encoder(
      self.depth,
      self.mlp_dim,
      self.num_heads,
      self.dropout,
      self.stochastic_depth,
      self.remat,
      self.scan,
      self.dtype,
      name="Transformer",
    )(x, not train)
    x = x[:, 0] if self.pool == "tok" else jnp.mean(x, axis=1)
    head = nn.Dense(self.num_classes, name="head", kernel_init=nn.initializers.zeros, dtype=self.dtype)
    return jnp.asarray(head(x), jnp.float32)

  def _posemb(self, length: int, h: int, w: int, width: int):
    if self.posemb == "learn":  # one per token, the class token's too (the original ViT's)
      return self.param("pos_embedding", nn.initializers.normal(stddev=1 / np.sqrt(width)), (1, length, width))
    if self.posemb == "sincos2d":
      pe = posemb_sincos_2d(h, w, width)
      return jnp.concatenate([jnp.zeros((1, 1, width)), pe], axis=1) if length == h * w + 1 else pe
    raise ValueError(f"posemb must be learn or sincos2d, got {self.posemb!r}")


_LAYER = re.compile(r"^(?P<stack>(?:.*/)?encoderblock)_(?P<i>\d+)/(?P<rest>.+)$")  # one of the unrolled blocks
_STACKED = re.compile(r"^(?P<stack>(?:.*/)?encoderblock)/(?P<rest>.+)$")  # the scanned blocks, stacked


def as_layout(have: dict, want, xp=np) -> dict:
  """``have`` (``{"a/b/kernel": array}``) with a ViT's blocks in the layout of ``want``'s names: the unrolled
  ``encoderblock_{i}/x`` stacked as ``encoderblock/x`` (``[depth, ...]``) where ``want`` has that name, and a
  stacked leaf cut into the unrolled ones where ``want`` has those, when the blocks are exactly ``0 .. n - 1``
  on both sides. Anything else is left as it is, for the caller to name (``pretrained.for_model``). ``xp``:
  ``np`` for host arrays (a checkpoint), ``jnp`` for device arrays and tracers."""

  def blocks(names, other):  # {stacked name: {i: unrolled name}} of the names whose stacked form is in other
    out = {}
    for name in names:
      m = _LAYER.match(name)
      if m and name not in other and f"{m['stack']}/{m['rest']}" in other:
        out.setdefault(f"{m['stack']}/{m['rest']}", {})[int(m["i"])] = name
    return out

  out = dict(have)
  for stacked, names in blocks(have, want).items():  # unrolled here, stacked in the model
    if stacked not in have and sorted(names) == list(range(len(names))):
      out[stacked] = xp.stack([xp.asarray(out.pop(names[i])) for i in range(len(names))])
  for stacked, names in blocks(want, have).items():  # stacked here, unrolled in the model
    value = xp.asarray(have[stacked])
    if stacked not in want and value.ndim and sorted(names) == list(range(value.shape[0])):
      out.update({name: value[i] for i, name in names.items()})
      del out[stacked]
  return out


def stack_blocks(params):
  """An unrolled ViT's parameters as the scanned model's (``scan=True``): ``Transformer/encoderblock_{i}``
  stacked along a new leading axis into ``Transformer/encoderblock`` (``as_layout``; ``jnp``, so under
  ``jit`` too); ``unstack_blocks`` is the inverse. Blocks not numbered ``0 .. depth - 1`` are a
  ``ValueError``."""
  flat = traverse_util.flatten_dict(params, sep="/")
  want = {_LAYER.sub(r"\g<stack>/\g<rest>", name) for name in flat}
  out = as_layout(flat, want, jnp)
  left = sorted(name for name in out if _LAYER.match(name))
  if left:
    raise ValueError(f"blocks not numbered 0 .. depth - 1 without a gap, left unstacked: {', '.join(left[:3])}")
  return traverse_util.unflatten_dict(out, sep="/")


def unstack_blocks(params):
  """A scanned ViT's parameters as the unrolled model's: the inverse of ``stack_blocks``."""
  flat, want = traverse_util.flatten_dict(params, sep="/"), set()
  for name, leaf in flat.items():
    m = _STACKED.match(name)
    want |= {f"{m['stack']}_{i}/{m['rest']}" for i in range(np.shape(leaf)[0])} if m else {name}
  return traverse_util.unflatten_dict(as_layout(flat, want, jnp), sep="/")


def create(
  name: str,
  num_classes: int,
  patch_size: Optional[int] = None,
  **kwargs,
) -> ViT:
  """The zoo's ViT ``name`` (``VARIANTS``), with its patch size unless ``patch_size`` is given."""
  size, patch = VARIANTS[name]
  width, depth, mlp_dim, heads = SIZES[size]
  return ViT(
    num_classes=num_classes,
    patch_size=patch_size or patch,
    width=width,
    depth=depth,
    mlp_dim=mlp_dim,
    num_heads=heads,
    **kwargs,
  )

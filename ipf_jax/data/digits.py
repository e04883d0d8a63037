"""scikit-learn's handwritten digits: 1797 real 8x8 images, shipped with the package."""

from __future__ import annotations

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from ipf_jax.data.arrays import ArrayDataset

TEST_FRACTION = 0.25
SPLIT_SEED = 0  # fixed: every run sees the same 1347 / 450 split


def upscale(images: np.ndarray, size: int) -> np.ndarray:
  """8 x 8 digits ``[N, 8, 8]`` in ``[0, 1]`` as ``[N, size, size, 1]`` float32 (bilinear, ink bright on black
  like Fashion-MNIST's objects; ``size`` 8: unchanged)."""
  if size != 8:
    from scipy import ndimage

    images = ndimage.zoom(images, (1, size / 8, size / 8), order=1, grid_mode=True, mode="grid-constant")
  return np.clip(images, 0.0, 1.0)[..., None].astype(np.float32)


def load(size: int = 8) -> ArrayDataset:
  """Fixed stratified 75/25 train/test split; pixels scaled from [0, 16] to [0, 1]; ``size`` > 8 upscales the
  images to ``size x size`` (``upscale``: 28 for a model of Fashion-MNIST, the same split)."""
  digits = load_digits()
  x, y = upscale(digits.images / 16.0, size), digits.target.astype(np.int32)
  x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=TEST_FRACTION, random_state=SPLIT_SEED, stratify=y)
  return ArrayDataset(
    name="digits" if size == 8 else f"digits_{size}x{size}",
    train={"image": x_tr, "label": y_tr},
    test={"image": x_te, "label": y_te},
    num_classes=10,
  )

"""scikit-learn's handwritten digits: 1797 real 8x8 images, shipped with the package."""

from __future__ import annotations

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from ipf_jax.data.arrays import ArrayDataset

TEST_FRACTION = 0.25
SPLIT_SEED = 0  # fixed: every run sees the same 1347 / 450 split


def load() -> ArrayDataset:
  """Fixed stratified 75/25 train/test split; pixels scaled from [0, 16] to [0, 1]."""
  x, y = load_digits(return_X_y=True)
  x = (x.reshape(-1, 8, 8, 1) / 16.0).astype(np.float32)
  y = y.astype(np.int32)
  x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=TEST_FRACTION, random_state=SPLIT_SEED, stratify=y)
  return ArrayDataset(
    name="digits", train={"image": x_tr, "label": y_tr}, test={"image": x_te, "label": y_te}, num_classes=10
  )

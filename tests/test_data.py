"""The embedded digits data, its harder variant, batch order and the prefetch thread."""

import numpy as np
import pytest

from ipf_jax.spmd import layout
from tests import helpers

pytestmark = pytest.mark.slow  # CI: leg 1 only (pytest.ini)


def test_digits_split_is_fixed_and_real():
  data = helpers.digits_data()
  assert data.train["image"].shape == (1347, 8, 8, 1) and data.test["image"].shape == (450, 8, 8, 1)
  assert data.train["image"].min() == 0.0 and data.train["image"].max() == 1.0
  from sklearn.datasets import load_digits

  full = load_digits()
  expected = 0.25 * np.bincount(full.target)
  assert np.all(np.abs(np.bincount(data.test["label"]) - expected) <= 1), "stratified 75/25 split"
  x = full.images.reshape(-1, 64) / 16.0
  rows = {r.tobytes() for r in x.astype(np.float32)}
  assert all(img.reshape(-1).tobytes() in rows for img in data.test["image"][:20])


def test_digits_at_28_are_the_same_split_upscaled():
  """``digits.load(28)`` (the transfer study's fine-tuning set) holds the 8 x 8 split's examples, each
  upscaled bilinearly (a plain scipy reference, not ``digits.upscale``), the same labels; and the OOD set's
  digits (``shifts.upscaled_digits``) are the same reference."""
  from scipy import ndimage
  from sklearn.datasets import load_digits

  from ipf_jax.data import digits, shifts

  small, big = digits.load(), digits.load(28)
  assert big.name == "digits_28x28" and big.train["image"].shape == (1347, 28, 28, 1)
  images = load_digits().images.astype(np.float32) / 16.0
  zoomed = ndimage.zoom(load_digits().images / 16.0, (1, 3.5, 3.5), order=1, grid_mode=True, mode="grid-constant")
  upscaled = np.clip(zoomed, 0.0, 1.0)[..., None].astype(np.float32)
  np.testing.assert_array_equal(shifts.upscaled_digits(), upscaled)
  for split in ("train", "test"):
    assert np.array_equal(getattr(small, split)["label"], getattr(big, split)["label"])
    # each 8 x 8 example's row in sklearn's order picks its upscaled twin
    rows = [int(np.flatnonzero((images == im[..., 0]).all(axis=(1, 2)))[0]) for im in getattr(small, split)["image"]]
    np.testing.assert_array_equal(getattr(big, split)["image"], upscaled[rows])


def test_batch_order_depends_only_on_seed_and_step():
  data = helpers.digits_data()
  per_epoch = data.steps_per_epoch(128)
  assert per_epoch == 1347 // 128
  a = data.train_batch(per_epoch + 3, 128, seed=5)
  b = next(data.train_batches(per_epoch + 3, 128, seed=5))
  np.testing.assert_array_equal(a["label"], b["label"])
  epoch0 = np.concatenate([data.train_batch(k, 128, 5)["label"] for k in range(per_epoch)])
  assert len(epoch0) == per_epoch * 128
  seen = np.concatenate(
    [
      np.nonzero((data.train["image"].reshape(1347, -1) == img.reshape(1, -1)).all(1))[0][:1]
      for k in range(2)
      for img in data.train_batch(k, 128, 5)["image"]
    ]
  )
  assert len(set(seen.tolist())) == 256, "no example twice within an epoch"


def test_harder_variant_subset_and_symmetric_noise():
  data = helpers.digits_data()
  hard = data.harder(0.2, 0.2)
  n = round(0.2 * 1347)
  assert len(hard.train["label"]) == n and hard.test["image"] is data.test["image"]
  # recover each kept image's clean label from the original split
  index = {img.tobytes(): i for i, img in enumerate(data.train["image"])}
  clean = np.array([data.train["label"][index[img.tobytes()]] for img in hard.train["image"]])
  flipped = clean != hard.train["label"]
  assert abs(flipped.mean() - 0.2) < 0.06 and flipped.any()
  again = data.harder(0.2, 0.2)
  np.testing.assert_array_equal(again.train["label"], hard.train["label"])


def test_prefetch_passes_batches_and_errors():
  out = list(layout.prefetch(iter(range(5)), lambda b: b * 10))
  assert out == [0, 10, 20, 30, 40]

  def broken():
    yield 1
    raise ValueError("bad record")

  got = []
  with pytest.raises(ValueError, match="bad record"):
    for b in layout.prefetch(broken(), lambda b: b):
      got.append(b)
  assert got == [1]
  closed = []

  def endless():
    try:
      yield from range(10**9)
    finally:
      closed.append(True)

  gen = layout.prefetch(endless(), lambda b: b)  # endless input, consumer stops early
  assert next(gen) == 0
  gen.close()
  assert closed == [True], "the source is closed by the thread that read it, not left to the interpreter's exit"


def test_a_set_smaller_than_the_eval_batch_is_one_batch_of_its_size():
  """A shifted set of 20 images is evaluated in one batch of 24 on 8 devices, not padded to 1,000 (which
  cost the Fashion-MNIST study 25 x 1,000 evaluated images for 25 x 20); a larger set keeps the batch."""
  import jax

  mesh = jax.make_mesh((4, 2), ("particle", "data"))
  assert layout.eval_batch_sizes(1000, mesh, examples=20) == (24, 24)
  assert layout.eval_batch_sizes(1000, mesh, examples=3) == (8, 8)
  assert layout.eval_batch_sizes(1000, mesh, examples=10000) == (1000, 1000)
  assert layout.eval_batch_sizes(250, mesh) == layout.eval_batch_sizes(250, mesh, examples=None) == (256, 256)

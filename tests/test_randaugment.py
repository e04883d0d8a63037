"""RandAugment in tf.data (issue: ViTs, optimizers, fine-tuning, item 3): each colour operation against PIL's
(``ImageOps``, ``ImageEnhance``), each geometric one against a numpy loop over output pixels, and the policy
stateless (the same seed, the same image; another seed, another)."""

import numpy as np
import pytest
from PIL import Image, ImageEnhance, ImageOps

pytestmark = pytest.mark.slow  # CI: leg 1 only (pytest.ini)

# TensorFlow (the "tfds" extra, leg 1's install) and the module that needs it are imported as a test starts, so
# that CI's leg 2, without them, collects this module to select by marks.
tf = ra = None


@pytest.fixture(autouse=True)
def _tensorflow():
  global tf, ra
  import tensorflow

  from ipf_jax.data import randaugment

  tf, ra = tensorflow, randaugment


def photo(channels=3, size=20, seed=0):
  """A smooth picture with texture (not uniform noise: equalize and autocontrast have work to do)."""
  rng = np.random.default_rng(seed)
  y, x = np.mgrid[:size, :size]
  base = 60 + 80 * np.sin(x / 3.0)[..., None] + 50 * np.cos(y / 4.0)[..., None] + rng.normal(0, 12, (size, size, 1))
  tint = np.array([1.0, 0.8, 0.6][:channels])
  return np.clip(base * tint, 0, 255).astype(np.uint8)


def pil(image):
  return Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image)


def back(pil_image, channels):
  out = np.asarray(pil_image)
  return out[..., None] if channels == 1 else out


def assert_within_one(actual, expected, name):
  diff = np.abs(np.asarray(actual, np.int32) - np.asarray(expected, np.int32))
  assert diff.max() <= 1, f"{name}: {diff.max()} levels apart at {np.argwhere(diff > 1)[:3].tolist()}"


@pytest.mark.parametrize("channels", [1, 3])
def test_colour_operations_match_pil(channels):
  image = photo(channels)
  img = pil(image)
  grey_stays = channels == 1  # PIL's Color on a grey image is the image
  cases = [  # (name, ours, PIL's, exact)
    ("autocontrast", ra.autocontrast(image), ImageOps.autocontrast(img), False),
    ("equalize", ra.equalize(image), ImageOps.equalize(img), True),
    ("invert", ra.invert(image), ImageOps.invert(img), True),
    ("posterize", ra.posterize(image, 4), ImageOps.posterize(img, 4), True),
    ("solarize", ra.solarize(image, 128), ImageOps.solarize(img, 128), True),
    ("contrast", ra.contrast(image, 1.9), ImageEnhance.Contrast(img).enhance(1.9), False),
    ("brightness", ra.brightness(image, 1.9), ImageEnhance.Brightness(img).enhance(1.9), False),
    ("sharpness", ra.sharpness(image, 1.9), ImageEnhance.Sharpness(img).enhance(1.9), False),
    ("color", ra.color(image, 0.4), img if grey_stays else ImageEnhance.Color(img).enhance(0.4), False),
  ]
  for name, ours, theirs, exact in cases:
    assert_within_one(ours.numpy(), back(theirs, channels), name)
    if exact:
      np.testing.assert_array_equal(ours.numpy(), back(theirs, channels), err_msg=name)
  added = ra.solarize_add(image, 110).numpy()
  want = np.where(image < 128, np.minimum(image.astype(np.int32) + 110, 255), image)
  np.testing.assert_array_equal(added, want)


def numpy_transform(image, matrix):
  """Output (x, y) from input (a0 x + a1 y + a2, b0 x + b1 y + b2), nearest (half away from zero), 128 outside."""
  h, w, _ = image.shape
  a = np.asarray(matrix, np.float32)
  out = np.full_like(image, 128)
  for y in range(h):
    for x in range(w):
      sx = np.float32(a[0] * x + a[1] * y + a[2])
      sy = np.float32(a[3] * x + a[4] * y + a[5])
      ix, iy = int(np.sign(sx) * np.floor(abs(sx) + 0.5)), int(np.sign(sy) * np.floor(abs(sy) + 0.5))
      if 0 <= ix < w and 0 <= iy < h:
        out[y, x] = image[iy, ix]
  return out


def test_geometric_operations_match_a_numpy_loop():
  image = photo(3, size=16)
  for name, ours, matrix in [
    ("shear_x", ra.shear_x(image, 0.27), [1, 0.27, 0, 0, 1, 0]),
    ("shear_y", ra.shear_y(image, -0.27), [1, 0, 0, -0.27, 1, 0]),
    ("translate_x", ra.translate_x(image, 5.0), [1, 0, -5, 0, 1, 0]),
    ("translate_y", ra.translate_y(image, -3.0), [1, 0, 0, 0, 1, 3]),
  ]:
    np.testing.assert_array_equal(ours.numpy(), numpy_transform(image, matrix), err_msg=name)
  # rotation about the centre: the centre pixel stays; 90 degrees is np.rot90 (on screen, counter-clockwise)
  odd = photo(1, size=15)
  np.testing.assert_array_equal(ra.rotate(odd, 90.0).numpy(), np.rot90(odd))
  np.testing.assert_array_equal(ra.rotate(odd, 0.0).numpy(), odd)
  rotated = ra.rotate(image, 30.0).numpy()
  assert (rotated == 128).all(axis=-1).sum() > 0, "corners filled with grey"


def test_cutout_is_a_grey_square_and_follows_its_seed():
  image = np.zeros((20, 20, 1), np.uint8)
  seed = tf.constant([3, 4], tf.int64)
  out = ra.cutout(image, 4, seed).numpy()[..., 0]
  ys, xs = np.nonzero(out == 128)
  assert len(ys) > 0 and (ys.max() - ys.min() + 1) <= 8 and (xs.max() - xs.min() + 1) <= 8
  assert len(ys) == (ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1), "a rectangle"
  np.testing.assert_array_equal(ra.cutout(image, 4, seed).numpy()[..., 0], out)


def test_policy_is_stateless_and_draws_operations_uniformly():
  image = photo(3, size=28)
  seed = tf.constant([7, 11], tf.int64)
  first = ra.randaugment(image, 2, 10, seed).numpy()
  np.testing.assert_array_equal(ra.randaugment(image, 2, 10, seed).numpy(), first)
  outs = [ra.randaugment(image, 1, 10, tf.constant([7, k], tf.int64)).numpy() for k in range(64)]
  distinct = {o.tobytes() for o in outs}
  assert len(distinct) >= 8, f"{len(distinct)} distinct results of 64 seeds"
  # inside tf.data (graph mode), as the pipeline runs it
  ds = tf.data.Dataset.from_tensors(image).map(lambda x: ra.randaugment(x, 2, 10, seed))
  np.testing.assert_array_equal(next(iter(ds)).numpy(), first)


def test_the_tfds_pipeline_with_randaugment_is_deterministic_and_resumable():
  """randaugment_layers=2: the pipeline's images change (against the same crop and flip without it), and a
  run resumed at step 3 reads the batches of an uninterrupted one."""
  import tensorflow_datasets as tfds

  from ipf_jax.data import tfds_input

  with tfds.testing.mock_data(num_examples=40):
    plain = tfds_input.TFDSDataset("cifar10", None, image_size=16, shuffle_buffer=64, small_images=True)
    ds = tfds_input.TFDSDataset(
      "cifar10", None, image_size=16, shuffle_buffer=64, small_images=True, randaugment=(2, 10.0)
    )
    first = [b for _, b in zip(range(5), ds.train_batches(0, 8, seed=3))]
    without = next(plain.train_batches(0, 8, seed=3))
    np.testing.assert_array_equal(first[0]["label"], without["label"])
    changed = [not np.allclose(a, b) for a, b in zip(first[0]["image"], without["image"])]
    assert sum(changed) >= 4, f"RandAugment changed {sum(changed)} of 8 images"
    for k, got in zip(range(3, 5), ds.train_batches(3, 8, seed=3)):
      np.testing.assert_array_equal(got["image"], first[k]["image"])

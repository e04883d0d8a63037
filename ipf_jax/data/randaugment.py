"""RandAugment (Cubuk et al. 2019) in tf.data, stateless: the same seed gives the same image, so a resumed run
sees the batches an uninterrupted one would (DESIGN.md §7).

The policy of TF's ``distort_image_with_randaugment`` (EfficientNet / TF Model Garden), which big_vision's
``randaug(2, 10)`` runs: ``num_layers`` times, one of 16 operations drawn uniformly, each at the shared
magnitude ``M`` of 10 levels; geometric ones fill with grey 128 and take a random sign.

  AutoContrast, Equalize, Invert                     no argument
  Rotate             M / 10 * 30 degrees             ShearX, ShearY        M / 10 * 0.3
  TranslateX, Y      M / 10 * 100 px at 224          Cutout                a square of 2 * M / 10 * 40 px at 224
  Posterize          int(M / 10 * 4) bits kept       Solarize              threshold int(M / 10 * 256)
  SolarizeAdd        + int(M / 10 * 110) below 128   Color, Contrast, Brightness, Sharpness: factor M / 10 * 1.8 + 0.1

Pixel lengths scale with the image (``translate_const`` 100 and ``cutout_const`` 40 are for 224 x 224), so a
28 x 28 image moves by 12 px at M = 10, not 100. The colour operations follow PIL's (``ImageOps``,
``ImageEnhance``), against which ``tests/test_randaugment.py`` checks them; ``Contrast`` blends with the
mean grey level as PIL does (TF's copy divides the histogram's sum by 256 instead). At M = 10, Solarize's
threshold is 256 and leaves the image as it is, as in TF's. Images are ``uint8 [H, W, C]``, C = 1 or 3.
"""

from __future__ import annotations

import math

import tensorflow as tf

MAX_LEVEL = 10.0
REPLACE = 128
TRANSLATE_CONST, CUTOUT_CONST, REFERENCE_SIZE = 100.0, 40.0, 224.0


def blend(image1, image2, factor):
  """``image1 + factor (image2 - image1)`` in float, clipped to [0, 255], as uint8 (PIL's ``Image.blend``,
  extrapolating for factors above 1)."""
  a, b = tf.cast(image1, tf.float32), tf.cast(image2, tf.float32)
  return tf.cast(tf.clip_by_value(tf.round(a + factor * (b - a)), 0.0, 255.0), tf.uint8)


def grey(image):
  """The luma of an RGB image (ITU-R 601-2, PIL's ``convert("L")``) as float ``[H, W, 1]``; a grey image as is."""
  image = tf.cast(image, tf.float32)
  if image.shape[-1] == 1:
    return image
  return tf.reduce_sum(image * tf.constant([0.299, 0.587, 0.114]), axis=-1, keepdims=True)


def autocontrast(image):
  """Each channel stretched from its [min, max] to [0, 255] (PIL's ``ImageOps.autocontrast``)."""
  x = tf.cast(image, tf.float32)
  lo = tf.reduce_min(x, axis=(0, 1), keepdims=True)
  hi = tf.reduce_max(x, axis=(0, 1), keepdims=True)
  scale = tf.where(hi > lo, 255.0 / tf.maximum(hi - lo, 1.0), 1.0)
  offset = tf.where(hi > lo, -lo * scale, 0.0)
  return tf.cast(tf.clip_by_value(tf.floor(x * scale + offset), 0.0, 255.0), tf.uint8)


def equalize(image):
  """Each channel's histogram equalised by PIL's rule (``ImageOps.equalize``): ``step`` = (pixels - the
  last non-empty bin's count) // 255, ``lut[i] = (cumsum[i - 1] + step // 2) // step``; step 0: unchanged."""

  def channel(c):
    c = tf.cast(c, tf.int32)
    hist = tf.math.bincount(tf.reshape(c, [-1]), minlength=256, maxlength=256)
    last = tf.gather(hist, tf.reduce_max(tf.where(hist > 0)))
    step = (tf.reduce_sum(hist) - last) // 255
    lut = tf.concat([[0], (tf.cumsum(hist)[:-1] + step // 2) // tf.maximum(step, 1)], 0)
    return tf.where(step > 0, tf.gather(tf.clip_by_value(lut, 0, 255), c), c)

  return tf.cast(tf.stack([channel(image[..., i]) for i in range(image.shape[-1])], axis=-1), tf.uint8)


def invert(image):
  return 255 - tf.convert_to_tensor(image)


def posterize(image, bits: int):
  """The ``bits`` highest bits of each value kept."""
  shift = 8 - bits
  return tf.bitwise.left_shift(tf.bitwise.right_shift(image, shift), shift)


def solarize(image, threshold: int):
  """Values at or above ``threshold`` inverted."""
  return tf.where(tf.cast(image, tf.int32) < threshold, image, 255 - image)


def solarize_add(image, addition: int, threshold: int = 128):
  """``addition`` added to the values below ``threshold`` (clipped to 255)."""
  added = tf.cast(tf.clip_by_value(tf.cast(image, tf.int32) + addition, 0, 255), tf.uint8)
  return tf.where(tf.cast(image, tf.int32) < threshold, added, image)


def color(image, factor):
  """Saturation (PIL's ``ImageEnhance.Color``): blend with the image's grey version; a grey image stays."""
  degenerate = tf.cast(tf.round(tf.broadcast_to(grey(image), tf.shape(image))), tf.uint8)
  return blend(degenerate, image, factor)


def contrast(image, factor):
  """PIL's ``ImageEnhance.Contrast``: blend with a flat image at the mean grey level (rounded)."""
  mean = tf.floor(tf.reduce_mean(grey(image)) + 0.5)
  return blend(tf.fill(tf.shape(image), mean), image, factor)


def brightness(image, factor):
  return blend(tf.zeros_like(image), image, factor)


def sharpness(image, factor):
  """PIL's ``ImageEnhance.Sharpness``: blend with the image smoothed by [[1, 1, 1], [1, 5, 1], [1, 1, 1]] / 13
  (the border pixels are their own smoothed version)."""
  x = tf.cast(image, tf.float32)[None]
  channels = image.shape[-1]
  kernel = tf.constant([[1.0, 1.0, 1.0], [1.0, 5.0, 1.0], [1.0, 1.0, 1.0]]) / 13.0
  kernel = tf.tile(kernel[:, :, None, None], [1, 1, channels, 1])
  smooth = tf.nn.depthwise_conv2d(x, kernel, strides=[1, 1, 1, 1], padding="VALID")[0]
  smooth = tf.cast(tf.clip_by_value(tf.round(smooth), 0.0, 255.0), tf.uint8)
  inner = tf.pad(tf.ones_like(smooth, tf.bool), [[1, 1], [1, 1], [0, 0]])
  degenerate = tf.where(inner, tf.pad(smooth, [[1, 1], [1, 1], [0, 0]]), image)
  return blend(degenerate, image, factor)


def transform(image, matrix):
  """Output pixel ``(x, y)`` from input ``(a0 x + a1 y + a2, b0 x + b1 y + b2)`` (``matrix`` =
  ``[a0, a1, a2, b0, b1, b2, 0, 0]``), nearest neighbour, grey 128 outside the image."""
  shape = tf.shape(image)
  out = tf.raw_ops.ImageProjectiveTransformV3(
    images=tf.cast(image, tf.float32)[None],
    transforms=tf.cast(tf.reshape(matrix, [1, 8]), tf.float32),
    output_shape=shape[:2],
    fill_value=float(REPLACE),
    interpolation="NEAREST",
    fill_mode="CONSTANT",
  )[0]
  return tf.cast(out, tf.uint8)


def rotate(image, degrees):
  """Rotated by ``degrees`` about the image's centre (counter-clockwise on screen for positive angles)."""
  h, w = float(image.shape[0] - 1), float(image.shape[1] - 1)
  a = degrees * math.pi / 180.0
  cos, sin = tf.cos(a), tf.sin(a)
  x_offset = (w - (cos * w - sin * h)) / 2.0
  y_offset = (h - (sin * w + cos * h)) / 2.0
  return transform(image, tf.stack([cos, -sin, x_offset, sin, cos, y_offset, 0.0, 0.0]))


def shear_x(image, level):
  return transform(image, tf.stack([1.0, level, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]))


def shear_y(image, level):
  return transform(image, tf.stack([1.0, 0.0, 0.0, level, 1.0, 0.0, 0.0, 0.0]))


def translate_x(image, pixels):
  return transform(image, tf.stack([1.0, 0.0, -pixels, 0.0, 1.0, 0.0, 0.0, 0.0]))


def translate_y(image, pixels):
  return transform(image, tf.stack([1.0, 0.0, 0.0, 0.0, 1.0, -pixels, 0.0, 0.0]))


def cutout(image, pad: int, seed):
  """A ``2 pad`` square (clipped at the borders) around a uniformly drawn centre, set to grey 128."""
  h, w = image.shape[0], image.shape[1]
  cy = tf.random.stateless_uniform([], seed, 0, h, tf.int32)
  cx = tf.random.stateless_uniform([], seed + tf.constant([0, 1], seed.dtype), 0, w, tf.int32)
  ys, xs = tf.range(h)[:, None, None], tf.range(w)[None, :, None]
  inside = (ys >= cy - pad) & (ys < cy + pad) & (xs >= cx - pad) & (xs < cx + pad)
  return tf.where(inside, tf.constant(REPLACE, tf.uint8), image)


def operations(magnitude: float, size: int, sign, seed):
  """The 16 operations at ``magnitude`` for ``size x size`` images, as functions of the image, in the
  policy's order. ``sign`` (+1 / -1): the geometric operations' direction."""
  m = magnitude / MAX_LEVEL
  enhance = m * 1.8 + 0.1
  scale = size / REFERENCE_SIZE
  return [
    autocontrast,
    equalize,
    invert,
    lambda x: rotate(x, sign * m * 30.0),
    lambda x: posterize(x, int(m * 4)),
    lambda x: solarize(x, int(m * 256)),
    lambda x: color(x, enhance),
    lambda x: contrast(x, enhance),
    lambda x: brightness(x, enhance),
    lambda x: sharpness(x, enhance),
    lambda x: shear_x(x, sign * m * 0.3),
    lambda x: shear_y(x, sign * m * 0.3),
    lambda x: translate_x(x, sign * tf.round(m * TRANSLATE_CONST * scale)),
    lambda x: translate_y(x, sign * tf.round(m * TRANSLATE_CONST * scale)),
    lambda x: cutout(x, int(round(m * CUTOUT_CONST * scale)), seed),
    lambda x: solarize_add(x, int(m * 110)),
  ]


NUM_OPERATIONS = 16


def randaugment(image, num_layers: int, magnitude: float, seed):
  """``num_layers`` operations, each drawn uniformly from the 16 with its own sign, applied in turn to the
  ``uint8 [H, W, C]`` image. ``seed``: a stateless seed ``[2]`` (int32 / int64); the same seed, the same
  image."""
  shape = image.shape
  seeds = tf.random.experimental.stateless_split(seed, 3 * num_layers)
  for layer in range(num_layers):
    op_seed, sign_seed, cut_seed = seeds[3 * layer], seeds[3 * layer + 1], seeds[3 * layer + 2]
    which = tf.random.stateless_uniform([], op_seed, 0, NUM_OPERATIONS, tf.int32)
    sign = tf.where(tf.random.stateless_uniform([], sign_seed) < 0.5, -1.0, 1.0)
    ops = operations(magnitude, image.shape[0], sign, cut_seed)
    image = tf.switch_case(which, [lambda f=f, x=image: f(x) for f in ops])
    image = tf.ensure_shape(image, shape)
  return image

"""Shifted and out-of-distribution evaluation sets (``config.eval_shifts``, ``config.ood_dataset``).

Digits: five corruptions of the test images, each at severities 1-5, computed
here (deterministic: a fixed seed per corruption and severity), and, as
out-of-distribution images, 8x8 grey patches of the two photographs that ship
with scikit-learn (``load_sample_images``: a Chinese temple and a flower).
Fashion-MNIST: the same five corruptions of its 10,000 test images (their
lengths, blur sigma and shift, scaled by the side: x 28/8), and as OOD
scikit-learn's digits upscaled to 28 x 28 (``digits``: the classic
Fashion-MNIST-vs-digits pairing, with sklearn's 1,797 in place of MNIST) or
28 x 28 photo patches (``photos``). TFDS: the corrupted and re-collected test
sets of CIFAR-10 and ImageNet and any TFDS image dataset as OOD, read like the
dataset's own eval split. ``ood_dataset`` may name several sets, comma-separated.
"""

from __future__ import annotations

import numpy as np

from ipf_jax.data.arrays import ArrayDataset
from ipf_jax.data.errors import DataError

SEVERITIES = (1, 2, 3, 4, 5)
SEED = 20_261_130

# Digits corruptions: the parameter of each severity (pixels in [0, 1], 8 x 8 images).
DIGITS_CORRUPTIONS = {
  "gaussian_noise": (0.08, 0.12, 0.18, 0.26, 0.38),  # noise standard deviation
  "blur": (0.3, 0.4, 0.5, 0.6, 0.75),  # Gaussian blur sigma, pixels
  "rotation": (5.0, 10.0, 15.0, 20.0, 30.0),  # degrees, the sign drawn per image
  "translation": (0.25, 0.5, 0.75, 1.0, 1.5),  # pixels, the direction drawn per image
  "contrast": (0.9, 0.8, 0.7, 0.6, 0.5),  # factor on the deviation from each image's mean
}
DIGITS_OOD = ("photos",)
# TFDS datasets whose shifted sets are the corruptions above, computed here on the eval split (images in
# [0, 255] scaled to [0, 1] and back), and the in-memory OOD sets each has.
ARRAY_SHIFTS = ("fashion_mnist",)
ARRAY_OOD = {"fashion_mnist": ("digits", "photos")}
PHOTOS = 1797  # photo patches beside a TFDS test set: as many as there are digits

# TFDS: the corruptions of CIFAR-10-C and ImageNet-C (TFDS configs ``<corruption>_<severity>``) and the
# other shifted test sets, by the dataset they shift.
CORRUPTIONS_C = (
  "gaussian_noise",
  "shot_noise",
  "impulse_noise",
  "defocus_blur",
  "glass_blur",
  "motion_blur",
  "zoom_blur",
  "snow",
  "frost",
  "fog",
  "brightness",
  "contrast",
  "elastic_transform",
  "pixelate",
  "jpeg_compression",
)
TFDS_SHIFTS = {
  "cifar10": {"corrupted": ("cifar10_corrupted", "test"), "sets": {"cifar10_1": ("cifar10_1", "test")}},
  "imagenet2012": {
    "corrupted": ("imagenet2012_corrupted", "validation"),
    "sets": {
      "imagenet_v2": ("imagenet_v2", "test"),
      "imagenet_a": ("imagenet_a", "test"),
      "imagenet_r": ("imagenet_r", "test"),
    },
  },
}


def corrupt(images: np.ndarray, corruption: str, severity: int) -> np.ndarray:
  """``images`` ``[N, S, S, C]`` in ``[0, 1]`` under ``corruption`` at ``severity`` (1-5), clipped to
  ``[0, 1]``; the same output on every call. Lengths (blur sigma, shift) are the 8 x 8 digits' times S/8."""
  from scipy import ndimage

  level = DIGITS_CORRUPTIONS[corruption][severity - 1]
  if corruption in ("blur", "translation"):
    level = level * images.shape[1] / 8
  rng = np.random.default_rng([SEED, sorted(DIGITS_CORRUPTIONS).index(corruption), severity])
  x = images.astype(np.float64)
  if corruption == "gaussian_noise":
    x = x + rng.normal(0.0, level, x.shape)
  elif corruption == "blur":
    x = ndimage.gaussian_filter(x, sigma=(0, level, level, 0), mode="constant")
  elif corruption == "rotation":
    signs = rng.choice([-1.0, 1.0], len(x))
    x = np.stack(
      [ndimage.rotate(im, s * level, axes=(0, 1), reshape=False, order=1, mode="constant") for im, s in zip(x, signs)]
    )
  elif corruption == "translation":
    angles = rng.uniform(0, 2 * np.pi, len(x))
    x = np.stack(
      [
        ndimage.shift(im, (level * np.sin(a), level * np.cos(a), 0), order=1, mode="constant")
        for im, a in zip(x, angles)
      ]
    )
  elif corruption == "contrast":
    mean = x.mean(axis=(1, 2, 3), keepdims=True)
    x = (x - mean) * level + mean
  else:
    raise KeyError(corruption)
  return np.clip(x, 0.0, 1.0).astype(np.float32)


corrupt_digits = corrupt  # the 8 x 8 digits' name


def upscaled_digits(size: int = 28) -> np.ndarray:
  """All 1,797 of scikit-learn's digits, ``[N, size, size, 1]`` in ``[0, 1]`` (bilinear upscaling from
  8 x 8, ink bright on black like Fashion-MNIST's objects)."""
  from sklearn.datasets import load_digits

  from ipf_jax.data import digits

  return digits.upscale(load_digits().images / 16.0, size)


def photo_patches(num: int, size: int = 8) -> np.ndarray:
  """``num`` grey ``size x size`` patches of scikit-learn's two sample photographs: random ``4 size``
  square crops (fixed seed; 32 x 32 for digits) block-averaged 4 x 4 (smaller blocks above 106 x 106),
  stretched to ``[0, 1]`` like the digits' ink."""
  from sklearn.datasets import load_sample_images

  photos = [im.astype(np.float64).mean(-1) for im in load_sample_images().images]
  rng = np.random.default_rng([SEED, 99])
  shortest = min(p.shape[0] for p in photos)
  block = max(1, min(4, shortest // size))  # 4 x 4 blocks up to 106 x 106 patches
  crop = size * block
  if crop >= shortest:
    raise DataError(
      f"photo patches of {size} x {size} do not fit in the sample photographs (427 x 640); "
      "use a smaller config.image_size or another ood_dataset"
    )
  out = []
  for i in range(num):
    photo = photos[i % len(photos)]
    r, c = rng.integers(0, photo.shape[0] - crop), rng.integers(0, photo.shape[1] - crop)
    patch = photo[r : r + crop, c : c + crop].reshape(size, block, size, block).mean((1, 3))
    lo, hi = patch.min(), patch.max()
    out.append((patch - lo) / max(hi - lo, 1e-6))
  return np.stack(out)[..., None].astype(np.float32)


def family(name: str) -> tuple:
  """``(corruption, severity)`` of a shifted set's name (``contrast_3``), ``(name, 0)`` for a set without
  severities (``cifar10_1``, ``imagenet_v2``)."""
  corruption, _, level = name.rpartition("_")
  if level.isdigit() and corruption in set(DIGITS_CORRUPTIONS) | set(CORRUPTIONS_C):
    return corruption, int(level)
  return name, 0


def names(eval_shifts: str, dataset_name: str) -> tuple:
  """The shifts ``eval_shifts`` (comma-separated; the config field) names for ``dataset_name`` (``all``: every
  one it has)."""
  known = known_shifts(dataset_name)
  asked = [s.strip() for s in eval_shifts.split(",") if s.strip()]
  if asked == ["all"]:
    return known
  unknown = [s for s in asked if s not in known]
  if unknown:
    from ipf_jax.errors import ConfigError

    raise ConfigError(
      "eval_shifts",
      f"{', '.join(unknown)} not known for dataset {dataset_name!r}; use 'all' "
      f"or some of: {', '.join(known) or '(none)'}",
    )
  return tuple(asked)


def known_shifts(dataset_name: str) -> tuple:
  if dataset_name in ("digits",) + ARRAY_SHIFTS:
    return tuple(DIGITS_CORRUPTIONS)
  if dataset_name in TFDS_SHIFTS:
    return CORRUPTIONS_C + tuple(TFDS_SHIFTS[dataset_name]["sets"])
  return ()


def eval_sets(shifts: tuple, dataset_name: str, dataset, shift_examples: int = 0) -> dict:
  """``{name: eval source}`` for every shift in ``shifts`` (``names``) of ``dataset``, the first
  ``shift_examples`` test examples (0: all); a corruption gives one set per severity,
  ``<corruption>_<severity>``; each has ``eval_batches(n)``, ``test_size`` and ``eval_process_local``."""
  if not shifts:
    return {}
  n = shift_examples or None
  if dataset_name == "digits":
    test = {k: v[:n] for k, v in dataset.test.items()}
    return {
      f"{c}_{s}": _arrays(f"digits/{c}_{s}", {**test, "image": corrupt(test["image"], c, s)})
      for c in shifts
      for s in SEVERITIES
    }
  if dataset_name in ARRAY_SHIFTS:
    from ipf_jax.data import tfds_input

    images, labels = tfds_input.test_images(dataset)
    images, labels = images[:n], labels[:n]  # uint8; each set is corrupted when it is evaluated
    return {
      f"{c}_{s}": tfds_input.ArrayEvalSet(
        f"{dataset_name}/{c}_{s}",
        images,
        labels,
        dataset,
        transform=lambda x, c=c, s=s: corrupt(x.astype(np.float32) / 255.0, c, s) * 255.0,
      )
      for c in shifts
      for s in SEVERITIES
    }
  table = TFDS_SHIFTS[dataset_name]
  out = {}
  for shift in shifts:
    if shift in table["sets"]:
      builder, split = table["sets"][shift]
      out[shift] = _tfds(dataset, builder, _first(split, n))
    else:
      builder, split = table["corrupted"]
      split = _first(split, n)
      out.update({f"{shift}_{s}": _tfds(dataset, f"{builder}/{shift}_{s}", split) for s in SEVERITIES})
  return out


def ood_names(ood_dataset: str) -> tuple:
  """The OOD sets ``ood_dataset`` (comma-separated; the config field) names, in order."""
  names_ = [s.strip() for s in ood_dataset.split(",") if s.strip()]
  if len(set(names_)) != len(names_):
    from ipf_jax.errors import ConfigError

    raise ConfigError("ood_dataset", f"{ood_dataset!r} names a set twice")
  return tuple(names_)


def ood_sets(names_: tuple, dataset_name: str, dataset, shift_examples: int = 0) -> dict:
  """``{name: eval source}`` of each OOD set in ``names_`` (``ood_names``), up to ``shift_examples`` examples
  (0: all): ``photos`` for digits; for Fashion-MNIST ``digits``, ``photos`` or a TFDS dataset; for the other
  TFDS datasets the name of any prepared TFDS image dataset (``svhn_cropped`` for CIFAR), its ``test`` split."""
  return {name: _ood_set(dataset_name, dataset, name, shift_examples) for name in names_}


def _ood_set(dataset_name: str, dataset, name: str, shift_examples: int):
  if dataset_name == "digits":
    if name != "photos":
      from ipf_jax.errors import ConfigError

      raise ConfigError(
        "ood_dataset",
        f"{name!r} is not available for digits; use 'photos' (8x8 patches of scikit-learn's sample photographs)",
      )
    images = photo_patches(shift_examples or dataset.test_size)
    return _arrays("photos", {"image": images, "label": np.zeros(len(images), np.int32)})
  if name in ARRAY_OOD.get(dataset_name, ()):
    from ipf_jax.data import tfds_input

    side = dataset.image_size
    images = (
      upscaled_digits(side)[: shift_examples or None]
      if name == "digits"
      else photo_patches(shift_examples or PHOTOS, side)
    )
    return tfds_input.ArrayEvalSet(name, images * 255.0, None, dataset)
  try:
    return _tfds(dataset, name, "test")
  except DataError as e:
    if dataset_name not in ARRAY_OOD:
      raise
    raise DataError(
      f"config.ood_dataset: {name!r} is neither one of {dataset_name}'s own OOD sets "
      f"({', '.join(ARRAY_OOD[dataset_name])}) nor a prepared TFDS dataset ({e})"
    ) from None


def _first(split: str, n) -> str:
  return f"{split}[:{n}]" if n else split


def _arrays(name: str, test: dict) -> ArrayDataset:
  return ArrayDataset(name=name, train={k: v[:1] for k, v in test.items()}, test=test)


def _tfds(dataset, builder_name: str, split: str):
  from ipf_jax.data import tfds_input

  if not isinstance(dataset, tfds_input.TFDSDataset):
    raise DataError(
      f"config.eval_shifts / ood_dataset: {builder_name} is a TFDS dataset; it needs a TFDS "
      f"dataset to train on (got {type(dataset).__name__})"
    )
  return tfds_input.TFDSEvalSet(builder_name, split, dataset)

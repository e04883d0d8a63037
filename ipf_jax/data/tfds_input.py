"""TFDS + tf.data input: per-host split, epoch-seeded shuffle, augmentation, padded eval.

The order of training examples is a function of ``(seed, step)``: epoch ``e``
shuffles with seed ``(seed, e)``, a resumed run skips the records of the steps
already done without decoding them, and augmentation uses stateless ops seeded
by the example's position in the stream.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterator, Optional

import jax
import numpy as np

# Per-channel statistics of the training sets, in [0, 255].
# Fashion-MNIST (grey): of its 60,000 training images (ipf_jax.data.prepare.read_fashion_mnist).
MEAN_RGB = {
  "imagenet2012": (123.675, 116.28, 103.53),
  "cifar10": (125.3, 123.0, 113.9),
  "cifar100": (129.3, 124.1, 112.4),
  "fashion_mnist": (72.94,),
}
STDDEV_RGB = {
  "imagenet2012": (58.395, 57.12, 57.375),
  "cifar10": (63.0, 62.1, 66.7),
  "cifar100": (68.2, 65.4, 70.4),
  "fashion_mnist": (90.02,),
}
EVAL_SPLIT = {"imagenet2012": "validation", "cifar10": "test", "cifar100": "test", "fashion_mnist": "test"}
CROP_PADDING = 32  # ImageNet eval: resize to image_size + 32, then center crop (224 -> 256 -> 224)


from ipf_jax.data.errors import DataError  # noqa: E402,F401 - re-exported


def _tf():
  import tensorflow as tf

  tf.config.set_visible_devices([], "GPU")  # tf.data only: leave the accelerators to JAX
  return tf


def _prepare_hint(name: str, data_dir: Optional[str]) -> str:
  where = data_dir or os.path.expanduser("~/tensorflow_datasets")  # no ~ after --config.data_dir= (not expanded)
  if name.split("/")[0] in ("imagenet2012", "imagenet2012_corrupted"):
    return (
      f"ImageNet must be downloaded by hand: put ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar into "
      f"{where}/downloads/manual/, then run `tfds build {name} --data_dir={where}` "
      f"(and pass --config.data_dir={where})."
    )
  if name == "fashion_mnist":
    from ipf_jax.data.prepare import GET_IT

    return f"To get it: {GET_IT.replace('DIR', where)}."
  return f"Prepare it on a machine with internet access: `tfds build {name} --data_dir={where}`."


def load_builder(name: str, data_dir: Optional[str], split: str = "train", field: str = "dataset"):
  """The prepared TFDS builder, or one ``DataError`` (naming ``config.<field>``) that says how to prepare it."""
  import tensorflow_datasets as tfds

  try:
    builder = tfds.builder(name, data_dir=data_dir)
  except Exception as e:  # noqa: BLE001 - unknown name, unreadable directory
    raise DataError(f"config.{field}: TFDS cannot open {name!r} in data_dir={data_dir or '(default)'}: {e}") from None
  try:
    builder.as_dataset(split=split)  # lazy; fails at once if the prepared files are missing
  except AssertionError:
    raise DataError(
      f"config.{field}: TFDS dataset {name!r} is not prepared in data_dir="
      f"{data_dir or builder.data_dir}. {_prepare_hint(name, data_dir)}"
    ) from None
  return builder


def _normalize(tf, image, name):
  image = tf.cast(image, tf.float32)
  return (image - tf.constant(MEAN_RGB[name])) / tf.constant(STDDEV_RGB[name])


def _random_resized_crop(tf, image, size, seed):
  """Inception-style crop (8%-100% area, 3/4-4/3 aspect), resized to ``size``."""
  begin, crop, _ = tf.image.stateless_sample_distorted_bounding_box(
    tf.shape(image),
    bounding_boxes=tf.constant([0.0, 0.0, 1.0, 1.0], tf.float32, [1, 1, 4]),
    seed=seed,
    min_object_covered=0.1,
    aspect_ratio_range=(3 / 4, 4 / 3),
    area_range=(0.08, 1.0),
    max_attempts=10,
    use_image_if_no_bounding_boxes=True,
  )
  image = tf.slice(image, begin, crop)
  return tf.image.resize(image, (size, size), method="bicubic")


def _center_crop(tf, image, size):
  """Resize the shorter side to ``size * 256/224`` (ImageNet) and take the central ``size`` square."""
  shape = tf.shape(image)
  h, w = tf.cast(shape[0], tf.float32), tf.cast(shape[1], tf.float32)
  scale = tf.cast(size + CROP_PADDING, tf.float32) / tf.minimum(h, w)
  image = tf.image.resize(
    image, (tf.cast(tf.round(h * scale), tf.int32), tf.cast(tf.round(w * scale), tf.int32)), method="bicubic"
  )
  return tf.image.resize_with_crop_or_pad(image, size, size)


SKIP_DECODING = True  # False decodes every record before the skip (benchmarks/resume_input.py compares)


def _num_examples(builder, split: str) -> int:
  try:
    return builder.info.splits[split].num_examples
  except KeyError:  # builders without split metadata (e.g. tfds.testing.mock_data)
    return int(builder.as_dataset(split=split).cardinality())


def decode_image(feature, encoded):
  """An image record's bytes to pixels (TFDS's own decoder for the feature)."""
  return feature.decode_example(encoded)


@dataclasses.dataclass
class TFDSDataset:
  """A TFDS classification dataset with the interface the trainer uses."""

  name: str
  data_dir: Optional[str]
  image_size: int
  shuffle_buffer: int = 16_384
  small_images: bool = False  # CIFAR: resize to image_size (no-op at 32), pad-4 random crop + flip
  randaugment: tuple = (0, 10.0)  # (layers, magnitude): RandAugment after the crop and flip; 0 layers: off

  process_local = True  # train batches hold only this process's examples
  eval_process_local = True  # and eval batches only this process's part of the eval split

  def __post_init__(self):
    self.builder = load_builder(self.name, self.data_dir)
    self.num_classes = self.builder.info.features["label"].num_classes
    self.num_train = self._num_examples("train")
    self.test_size = self._num_examples(EVAL_SPLIT[self.name])
    self.channels = self.builder.info.features["image"].shape[-1] or 3  # 1 for grey (Fashion-MNIST)
    self.image_shape = (self.image_size, self.image_size, self.channels)

  def _num_examples(self, split: str) -> int:
    return _num_examples(self.builder, split)

  @property
  def train_size(self) -> int:
    return self.num_train

  @property
  def example(self) -> dict:
    """One example's fields, ``[1, ...]`` (what a model is initialised from)."""
    return {"image": np.zeros((1,) + self.image_shape, np.float32), "label": np.zeros((1,), np.int32)}

  def steps_per_epoch(self, global_batch_size: int) -> int:
    return self.num_train // global_batch_size

  def _train_dataset(self, epoch: int, skip: int, local_batch: int, seed: int):
    tf = _tf()
    import tensorflow_datasets as tfds

    split = tfds.split_for_jax_process("train", drop_remainder=True)
    options = tf.data.Options()
    options.deterministic = True
    options.threading.private_threadpool_size = 0
    read = tfds.ReadConfig(shuffle_seed=seed * 100_003 + epoch, options=options)
    # Images stay encoded through the shuffle and the skip: a run resumed at step k of an epoch reads the
    # k skipped batches' records but decodes none of them (and the shuffle buffer holds encoded bytes).
    decoders = {"image": tfds.decode.SkipDecoding()} if SKIP_DECODING else None
    ds = self.builder.as_dataset(split=split, shuffle_files=True, read_config=read, decoders=decoders)
    ds = ds.shuffle(self.shuffle_buffer, seed=seed * 100_003 + epoch, reshuffle_each_iteration=False)
    ds = ds.enumerate().skip(skip)
    name, size, small, channels = self.name, self.image_size, self.small_images, self.channels
    image_feature = self.builder.info.features["image"]
    layers, magnitude = self.randaugment

    def augment(index, example):
      key = tf.stack([tf.cast(seed * 100_003 + epoch, tf.int64), index])
      crop_seed, flip_seed = key, key + tf.constant([0, 1 << 40], tf.int64)
      image = decode_image(image_feature, example["image"]) if SKIP_DECODING else example["image"]
      if small:  # CIFAR, Fashion-MNIST: pad 4, random crop, flip
        image = tf.image.resize(image, (size, size))  # identity at the native 32x32 (28x28)
        image = tf.image.resize_with_crop_or_pad(image, size + 8, size + 8)
        image = tf.image.stateless_random_crop(image, (size, size, channels), seed=crop_seed)
      else:
        image = _random_resized_crop(tf, image, size, crop_seed)
      image = tf.image.stateless_random_flip_left_right(image, seed=flip_seed)
      if layers:  # on the pixels the crop gave, as uint8 (PIL's operations), seeded by the example
        from ipf_jax.data import randaugment

        pixels = tf.cast(tf.clip_by_value(tf.round(image), 0.0, 255.0), tf.uint8)
        pixels.set_shape((size, size, channels))
        augment_seed = key + tf.constant([0, 2 << 40], tf.int64)
        image = randaugment.randaugment(pixels, layers, magnitude, augment_seed)
      return {"image": _normalize(tf, image, name), "label": tf.cast(example["label"], tf.int32)}

    ds = ds.map(augment, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds.batch(local_batch, drop_remainder=True).prefetch(2)

  def train_batches(self, start_step: int, global_batch_size: int, seed: int) -> Iterator[dict]:
    """This process's ``global_batch_size / process_count`` examples of each step from ``start_step`` on."""
    local_batch = global_batch_size // jax.process_count()
    per_epoch = self.steps_per_epoch(global_batch_size)
    if per_epoch == 0:
      raise DataError(
        f"config.global_batch_size: {global_batch_size} exceeds the {self.num_train} training examples of {self.name}"
      )
    step = start_step
    while True:
      epoch, first = divmod(step, per_epoch)
      for batch in self._train_dataset(epoch, first * local_batch, local_batch, seed).take(per_epoch - first):
        yield {k: v.numpy() for k, v in batch.items()}
        step += 1

  def eval_batches(self, batch_size: int) -> Iterator[dict]:
    """This process's part of the eval split (``tfds.split_for_jax_process``: near-equal parts, every
    example in one) in batches of at most ``batch_size`` (the evaluation pads and masks the last one)."""
    return _eval_batches(self.builder, EVAL_SPLIT[self.name], self, batch_size)


def _eval_batches(builder, split: str, like: TFDSDataset, batch_size: int) -> Iterator[dict]:
  """``split`` of ``builder`` preprocessed as ``like``'s eval split (crop or resize, its normalisation)."""
  import tensorflow_datasets as tfds

  ds = builder.as_dataset(split=tfds.split_for_jax_process(split, drop_remainder=False), shuffle_files=False)
  return _preprocessed_batches(ds, like, batch_size, cropped=builder.info.name == "imagenet2012_corrupted")


def _preprocessed_batches(ds, like: TFDSDataset, batch_size: int, cropped: bool = False) -> Iterator[dict]:
  """The examples of the ``tf.data`` dataset ``ds`` (``image`` in [0, 255], optional ``label``) preprocessed
  as ``like``'s eval split, in batches of at most ``batch_size``. ``cropped``: already the centre crop."""
  tf = _tf()
  name, size, small, channels = like.name, like.image_size, like.small_images, like.channels

  def preprocess(example):
    image = example["image"]
    if image.shape[-1] == 1 and channels == 3:  # grey images (an OOD set) as RGB
      image = tf.image.grayscale_to_rgb(image)
    elif image.shape[-1] == 3 and channels == 1:  # colour images (an OOD set) as grey
      image = tf.image.rgb_to_grayscale(image)
    if small:
      image = tf.image.resize(image, (size, size))
    elif cropped:  # ImageNet-C: already the 224 x 224 centre crop of the validation image
      image = tf.image.resize_with_crop_or_pad(image, size, size)
    else:
      image = _center_crop(tf, image, size)
    return {"image": _normalize(tf, image, name), "label": tf.cast(example.get("label", 0), tf.int32)}

  ds = ds.map(preprocess, num_parallel_calls=tf.data.AUTOTUNE)
  for batch in ds.batch(batch_size).prefetch(2):
    yield {k: v.numpy() for k, v in batch.items()}


class TFDSEvalSet:
  """A shifted or OOD eval set (``data.shifts``): ``split`` of the TFDS dataset ``builder_name``, read
  and preprocessed as ``like``'s eval split."""

  eval_process_local = True

  def __init__(self, builder_name: str, split: str, like: TFDSDataset):
    self.name, self.split, self.like = builder_name, split, like
    self.builder = load_builder(builder_name, like.data_dir, split, field="eval_shifts / ood_dataset")
    self.test_size = _num_examples(self.builder, split)

  def eval_batches(self, batch_size: int) -> Iterator[dict]:
    return _eval_batches(self.builder, self.split, self.like, batch_size)


class ArrayEvalSet:
  """A shifted or OOD eval set held in memory (``data.shifts``: corrupted copies of a test split, images
  from elsewhere): ``images`` ``[N, H, W, C]`` in [0, 255], preprocessed as ``like``'s eval split. Each
  process reads its own near-equal part."""

  eval_process_local = True

  def __init__(self, name: str, images: np.ndarray, labels: Optional[np.ndarray], like: TFDSDataset, transform=None):
    self.name, self.like, self.images, self.transform = name, like, images, transform
    self.labels = np.zeros(len(images), np.int32) if labels is None else np.asarray(labels, np.int32)
    self.test_size = len(self.images)

  def eval_batches(self, batch_size: int) -> Iterator[dict]:
    """``transform`` (e.g. a corruption, which draws per image) runs on the whole set, here, so that a set
    is the same whatever the process count and only one set is in memory at a time."""
    tf = _tf()
    images = np.asarray(self.images if self.transform is None else self.transform(self.images), np.float32)
    part = np.array_split(np.arange(self.test_size), jax.process_count())[jax.process_index()]
    ds = tf.data.Dataset.from_tensor_slices({"image": images[part], "label": self.labels[part]})
    return _preprocessed_batches(ds, self.like, batch_size)


def test_images(dataset: TFDSDataset) -> tuple:
  """``(images uint8 [N, H, W, C], labels)`` of ``dataset``'s whole eval split, in TFDS's order."""
  import tensorflow_datasets as tfds

  _tf()
  ds = dataset.builder.as_dataset(split=EVAL_SPLIT[dataset.name], shuffle_files=False, batch_size=-1)
  arrays = tfds.as_numpy(ds)
  return arrays["image"], arrays["label"].astype(np.int32)

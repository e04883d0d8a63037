"""The input (docs/DESIGN.md §8): datasets by name, ``create_dataset(config)``, as host-side iterators of
numpy batches with an epoch and a position, so a resumed run reads on from where it stopped. ``digits`` is
embedded (scikit-learn); the others are read with TFDS from ``config.data_dir`` and must have been prepared
there (``fashion_mnist`` from Debian's files: ``python -m ipf_jax.data.prepare fashion_mnist``). Also the
user's own arrays (``ArrayDataset``) or batch functions (``Data``), and the shifted and OOD evaluation sets.
Knows nothing of the mesh: ``ipf_jax.spmd.layout`` places a batch on it.
"""

from __future__ import annotations

import os

import ml_collections

from ipf_jax.errors import ConfigError

TFDS_DATASETS = ("imagenet2012", "cifar10", "cifar100", "fashion_mnist")
DATASETS = ("digits",) + TFDS_DATASETS


def create_dataset(config: ml_collections.ConfigDict):
  """The dataset ``config.dataset`` names. Every dataset (and ``ArrayDataset``, ``Data`` for your own)
  has ``name``, ``num_classes``, ``train_size``, ``test_size``, ``example`` (one example per field),
  ``process_local``, ``steps_per_epoch(G)``, ``train_batches(start_step, G, seed)`` and
  ``eval_batches(n)``."""
  if config.dataset == "digits":
    from ipf_jax.data import digits

    data = digits.load()
    if config.calibration_fraction:  # before the label noise: the temperature is fitted on clean labels
      data = data.holdout(config.calibration_fraction)
    if config.train_fraction < 1 or config.label_noise > 0:
      data = data.harder(config.train_fraction, config.label_noise)
    return data
  if config.dataset in TFDS_DATASETS:
    from ipf_jax.data import tfds_input  # imports TensorFlow: only for TFDS datasets

    data_dir = os.path.expanduser(config.data_dir) if config.data_dir else None  # "~/..." in a config file
    return tfds_input.TFDSDataset(
      config.dataset,
      data_dir,
      config.image_size,
      shuffle_buffer=config.shuffle_buffer,
      small_images=config.dataset != "imagenet2012",
      randaugment=(config.randaugment_layers, config.randaugment_magnitude),
    )
  raise ConfigError("dataset", f"unknown dataset {config.dataset!r}; use one of {', '.join(DATASETS)}")

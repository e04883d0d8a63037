"""Prepare a TFDS dataset from files already on this machine (no download).

  python -m ipf_jax.data.prepare fashion_mnist --data_dir DIR [--source /usr/share/datasets/fashion-mnist]

``fashion_mnist``: Zalando's Fashion-MNIST as Debian's ``dataset-fashion-mnist``
installs it (``apt-get install dataset-fashion-mnist``: the original IDX files,
``train-images-idx3-ubyte.gz`` and so on) or as the dataset's own repository
ships it. The files are written into ``DIR`` by TFDS's own catalogue builder
(``tfds.image_classification.FashionMNIST``: same name, version, features,
splits and example order) with its download step replaced by the local files,
so ``tfds.builder("fashion_mnist", data_dir=DIR)`` then reads exactly what
``tfds build fashion_mnist`` would have written. The files are checked first
(IDX magic numbers, 60,000 + 10,000 28x28 images, labels 0-9) and a dataset
already prepared in ``DIR`` is left alone.
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import sys
import tempfile
from typing import Optional

import numpy as np

from ipf_jax.data.errors import DataError

DEBIAN_SOURCE = {"fashion_mnist": "/usr/share/datasets/fashion-mnist"}
FILES = {
  "train_data": "train-images-idx3-ubyte",
  "train_labels": "train-labels-idx1-ubyte",
  "test_data": "t10k-images-idx3-ubyte",
  "test_labels": "t10k-labels-idx1-ubyte",
}
COUNTS = {"train": 60_000, "test": 10_000}
SIDE = 28
GET_IT = (
  "install Debian's copy (`apt-get install dataset-fashion-mnist`, files under "
  "/usr/share/datasets/fashion-mnist) and run `python -m ipf_jax.data.prepare fashion_mnist --data_dir DIR`, "
  "or on a machine with internet access `tfds build fashion_mnist --data_dir DIR`; then pass "
  "--config.data_dir=DIR"
)


def _find(source: str, stem: str) -> str:
  for name in (stem + ".gz", stem):
    path = os.path.join(source, name)
    if os.path.isfile(path):
      return path
  raise DataError(f"--source {source}: no {stem}.gz (or {stem}) there. To get Fashion-MNIST: {GET_IT}")


def _read_idx(path: str) -> np.ndarray:
  """An IDX file (``.gz`` or plain) as an array, its header checked."""
  opener = gzip.open if path.endswith(".gz") else open
  try:
    with opener(path, "rb") as f:
      data = f.read()
  except (OSError, EOFError) as e:
    raise DataError(
      f"{path}: cannot be read ({e}); reinstall it (`apt-get install --reinstall dataset-fashion-mnist`)"
    ) from None
  if len(data) < 8 or data[:2] != b"\0\0" or data[2] != 8:
    raise DataError(f"{path}: not an IDX file of unsigned bytes (its header is {data[:4].hex()})")
  ndim = data[3]
  shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
  body = data[4 + 4 * ndim :]
  if len(body) != int(np.prod(shape)):
    raise DataError(
      f"{path}: the header says {shape} ({int(np.prod(shape))} bytes), the file holds {len(body)}: "
      "truncated or damaged; reinstall it"
    )
  return np.frombuffer(body, np.uint8).reshape(shape)


def read_fashion_mnist(source: str) -> dict:
  """``{"train": (images [60000, 28, 28], labels), "test": (...)}`` from the IDX files in ``source``,
  checked: counts, image size, labels 0-9."""
  if not os.path.isdir(source):
    raise DataError(f"--source {source}: no such folder. To get Fashion-MNIST: {GET_IT}")
  out = {}
  for split, count in COUNTS.items():
    images = _read_idx(_find(source, FILES[f"{split}_data"]))
    labels = _read_idx(_find(source, FILES[f"{split}_labels"]))
    if images.shape != (count, SIDE, SIDE) or labels.shape != (count,):
      raise DataError(
        f"{source}: the {split} files hold images {images.shape} and labels {labels.shape}, "
        f"not Fashion-MNIST's ({count}, {SIDE}, {SIDE}) and ({count},)"
      )
    if labels.max() > 9:
      raise DataError(f"{source}: the {split} labels go up to {labels.max()}; Fashion-MNIST has 10 classes")
    out[split] = images, labels
  return out


def prepared(name: str, data_dir: str) -> bool:
  """Whether TFDS finds ``name`` prepared in ``data_dir``."""
  import tensorflow_datasets as tfds

  try:
    return tfds.builder(name, data_dir=data_dir).is_prepared()
  except Exception:  # noqa: BLE001 - an unreadable folder is "not prepared"; writing then says why
    return False


def _local_builder(data_dir: str, unpacked: dict):
  """TFDS's own ``fashion_mnist`` builder whose download step returns ``unpacked`` (the IDX files)."""
  import tensorflow_datasets as tfds

  class _LocalFiles:  # the one method of tfds.download.DownloadManager the builder calls
    def download_and_extract(self, urls: dict) -> dict:
      return {key: unpacked[key] for key in urls}

  class FashionMNISTFromFiles(tfds.image_classification.FashionMNIST, skip_registration=True):
    name = "fashion_mnist"

    def _split_generators(self, dl_manager):
      del dl_manager
      return super()._split_generators(_LocalFiles())

  return FashionMNISTFromFiles(data_dir=data_dir)


def prepare_fashion_mnist(data_dir: Optional[str] = None, source: str = DEBIAN_SOURCE["fashion_mnist"]) -> str:
  """Write TFDS's ``fashion_mnist`` into ``data_dir`` (TFDS's default folder when ``None``) from the IDX
  files in ``source``; returns the dataset's folder. Does nothing when it is already prepared there."""
  import tensorflow_datasets as tfds

  data_dir = os.path.expanduser(data_dir) if data_dir else None
  if prepared("fashion_mnist", data_dir):
    return tfds.builder("fashion_mnist", data_dir=data_dir).data_dir
  read_fashion_mnist(source)  # every check before anything is written
  with tempfile.TemporaryDirectory(prefix="fashion_mnist_idx_") as tmp:
    unpacked = {}
    for key, stem in FILES.items():
      path, dst = _find(source, stem), os.path.join(tmp, stem)
      with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f, open(dst, "wb") as g:
        shutil.copyfileobj(f, g)
      unpacked[key] = dst
    builder = _local_builder(data_dir, unpacked)
    if not sys.stderr.isatty():
      tfds.disable_progress_bar()  # a log (CI) gets the one line at the end, not a bar per split
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(try_download_gcs=False))
  return builder.data_dir


DATASETS = {"fashion_mnist": prepare_fashion_mnist}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m ipf_jax.data.prepare", description=__doc__.split("\n\n")[0])
  parser.add_argument("dataset", choices=sorted(DATASETS))
  parser.add_argument(
    "--data_dir",
    default=None,
    help="TFDS data folder to write into (default: TFDS's, ~/tensorflow_datasets); pass it to --config.data_dir",
  )
  parser.add_argument(
    "--source", default=None, help=f"folder of the original files (default: Debian's, {DEBIAN_SOURCE['fashion_mnist']})"
  )
  args = parser.parse_args(argv)
  source = args.source or DEBIAN_SOURCE[args.dataset]
  try:
    was = prepared(args.dataset, os.path.expanduser(args.data_dir) if args.data_dir else None)
    where = DATASETS[args.dataset](args.data_dir, source)
  except DataError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  print(f"{args.dataset}: {'already prepared' if was else 'prepared'} in {where}")
  data_flag = f" --config.data_dir={os.path.abspath(os.path.expanduser(args.data_dir))}" if args.data_dir else ""
  print(f"train with: python train.py --config configs/{args.dataset}.py{data_flag} --workdir runs/{args.dataset}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""Fashion-MNIST from Debian's files (``apt-get install dataset-fashion-mnist``, which ``.ci/run`` does):
``python -m ipf_jax.data.prepare``, the TFDS pipeline on the real files, its shifted and OOD sets, and
train.py on it, resumed mid-epoch."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from ipf_jax.config import read
from ipf_jax.data import prepare, tfds_input
from tests import helpers

pytestmark = pytest.mark.slow  # CI: leg 1 only (pytest.ini)

SOURCE = prepare.DEBIAN_SOURCE["fashion_mnist"]


@pytest.fixture(scope="session")
def source(fashion_dir):
  return SOURCE  # the fixture fashion_dir (conftest.py) has checked that it is there


@pytest.fixture(scope="session")
def data_dir(fashion_dir):
  return fashion_dir


def run_prepare(*args):
  return subprocess.run(
    [sys.executable, "-m", "ipf_jax.data.prepare", "fashion_mnist", *args],
    cwd=helpers.ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )


def digests(images):
  return [hashlib.sha1(im.tobytes()).hexdigest() for im in images]


def test_prepared_is_tfds_catalogue_fashion_mnist_holding_the_idx_files(source, data_dir):
  import tensorflow_datasets as tfds

  builder = tfds.builder("fashion_mnist", data_dir=data_dir)
  assert type(builder) is tfds.image_classification.FashionMNIST  # the catalogue's own builder reads it
  assert str(builder.info.version) == "3.0.1"
  catalogue = tfds.builder("fashion_mnist", data_dir=os.path.join(data_dir, "nothing-here")).info
  assert builder.info.features.to_json() == catalogue.features.to_json()
  assert builder.info.features["label"].names[0] == "T-shirt/top"
  assert {k: v.num_examples for k, v in builder.info.splits.items()} == {"train": 60_000, "test": 10_000}
  idx = prepare.read_fashion_mnist(source)
  for split in ("train", "test"):
    got = tfds.as_numpy(builder.as_dataset(split=split, batch_size=-1))
    images, labels = idx[split]
    assert got["image"].shape == images.shape + (1,) and got["image"].dtype == np.uint8
    np.testing.assert_array_equal(np.bincount(got["label"]), np.bincount(labels))
    # the same images with the same labels, whatever order TFDS wrote them in
    pairs = sorted(zip(digests(got["image"][..., 0]), got["label"].tolist()))
    want = sorted(zip(digests(images), labels.tolist()))
    assert pairs == want, split


def test_prepare_again_leaves_the_dataset_alone(data_dir):
  folder = os.path.join(data_dir, "fashion_mnist", "3.0.1")
  before = {f: os.stat(os.path.join(folder, f)).st_mtime_ns for f in os.listdir(folder)}
  r = run_prepare("--data_dir", data_dir)
  assert r.returncode == 0, r.stderr[-2000:]
  assert f"fashion_mnist: already prepared in {folder}" in r.stdout
  assert {f: os.stat(os.path.join(folder, f)).st_mtime_ns for f in os.listdir(folder)} == before


def test_no_files_and_no_dataset_is_one_error_naming_both_ways(tmp_path):
  r = run_prepare("--data_dir", str(tmp_path / "tfds"), "--source", str(tmp_path / "none"))
  assert r.returncode == 1
  assert r.stderr.count("error:") == 1 and "Traceback" not in r.stderr
  assert "apt-get install dataset-fashion-mnist" in r.stderr and "tfds build fashion_mnist" in r.stderr
  assert not (tmp_path / "tfds" / "fashion_mnist").exists()
  with pytest.raises(tfds_input.DataError) as e:  # the trainer's side
    tfds_input.TFDSDataset("fashion_mnist", str(tmp_path / "tfds"), image_size=28, small_images=True)
  assert "python -m ipf_jax.data.prepare fashion_mnist" in str(e.value) and "tfds build" in str(e.value)


def test_the_builder_is_found_from_python_too(tmp_path):
  """A library user calls ``prepare_fashion_mnist`` from Python, where TFDS locates the builder's module through
  ``importlib_resources`` (``python -m ipf_jax.data.prepare`` runs it as ``__main__`` and never asks)."""
  path = prepare._local_builder(str(tmp_path), {}).code_path
  assert str(path).endswith(os.path.join("ipf_jax", "data", "prepare.py")), path


def test_damaged_file_is_named_and_nothing_is_written(source, tmp_path):
  damaged = tmp_path / "src"
  shutil.copytree(source, damaged)
  path = damaged / "t10k-labels-idx1-ubyte.gz"
  import gzip

  with gzip.open(path, "rb") as f:
    data = f.read()
  with gzip.open(path, "wb") as f:
    f.write(data[:5000])  # truncated
  r = run_prepare("--data_dir", str(tmp_path / "tfds"), "--source", str(damaged))
  assert r.returncode == 1 and "Traceback" not in r.stderr
  assert f"{path}: the header says (10000,)" in r.stderr and "truncated" in r.stderr
  assert not (tmp_path / "tfds" / "fashion_mnist").exists()


def test_train_batches_on_the_real_files_are_augmented_deterministic_and_resumable(data_dir):
  ds = tfds_input.TFDSDataset("fashion_mnist", data_dir, image_size=28, shuffle_buffer=1024, small_images=True)
  assert (ds.num_train, ds.test_size, ds.num_classes, ds.image_shape) == (60_000, 10_000, 10, (28, 28, 1))
  assert ds.steps_per_epoch(64) == 937
  stream = ds.train_batches(0, 64, seed=5)
  first = [next(stream) for _ in range(6)]
  b = first[0]
  assert b["image"].shape == (64, 28, 28, 1) and b["image"].dtype == np.float32
  assert abs(float(b["image"].mean())) < 0.3 and 0.7 < float(b["image"].std()) < 1.3  # normalised
  resumed = ds.train_batches(4, 64, seed=5)  # resumed mid-epoch at step 4
  for k in (4, 5):
    got = next(resumed)
    np.testing.assert_array_equal(got["label"], first[k]["label"])
    np.testing.assert_array_equal(got["image"], first[k]["image"])
  # augmentation (pad-4 random crop, flip): a training image is its stored pixels only by chance (1 in 162)
  import tensorflow_datasets as tfds

  stored = tfds.as_numpy(ds.builder.as_dataset(split="train", batch_size=-1))["image"]
  stored = {hashlib.sha1(im.tobytes()).hexdigest() for im in stored}
  mean, std = tfds_input.MEAN_RGB["fashion_mnist"][0], tfds_input.STDDEV_RGB["fashion_mnist"][0]
  pixels = [np.round(x * std + mean).clip(0, 255).astype(np.uint8) for b in first for x in b["image"]]
  as_stored = sum(hashlib.sha1(p.tobytes()).hexdigest() in stored for p in pixels)
  assert as_stored <= 12, f"{as_stored} of {len(pixels)} training images are not augmented"


def test_shifted_and_ood_sets_against_numpy(data_dir):
  import tensorflow_datasets as tfds

  from configs import fashion_mnist

  config = fashion_mnist.get_config()
  config.data_dir, config.eval_shifts, config.shift_examples = data_dir, "contrast,translation", 64
  config.ood_dataset = "digits,photos"
  ds = tfds_input.TFDSDataset("fashion_mnist", data_dir, image_size=28, small_images=True)
  sets = read.eval_sets(config, ds)
  assert sorted(sets) == sorted(f"{c}_{s}" for c in ("contrast", "translation") for s in range(1, 6))
  test = tfds.as_numpy(ds.builder.as_dataset(split="test", batch_size=-1))
  x = test["image"][:64].astype(np.float64) / 255.0
  mean, std = tfds_input.MEAN_RGB["fashion_mnist"][0], tfds_input.STDDEV_RGB["fashion_mnist"][0]
  # contrast at severity 3: each image's deviation from its mean times 0.7 (numpy, independent of shifts.py)
  m = x.mean(axis=(1, 2, 3), keepdims=True)
  want = (np.clip((x - m) * 0.7 + m, 0, 1) * 255.0 - mean) / std
  got = np.concatenate([b["image"] for b in sets["contrast_3"].eval_batches(30)])
  np.testing.assert_allclose(got, want, atol=2e-4)
  labels = np.concatenate([b["label"] for b in sets["contrast_3"].eval_batches(30)])
  np.testing.assert_array_equal(labels, test["label"][:64])
  moved = np.concatenate([b["image"] for b in sets["translation_5"].eval_batches(64)])
  assert np.abs(moved - (x * 255.0 - mean) / std).mean() > 0.1  # 5.25 pixels: a real shift at 28 x 28
  # blur at severity 5: sigma 0.75 on 8 x 8 digits, scaled to 28 x 28 (x 3.5)
  from scipy import ndimage

  blurred = np.clip(ndimage.gaussian_filter(x, sigma=(0, 2.625, 2.625, 0), mode="constant"), 0, 1)
  config.eval_shifts = "blur"
  got = np.concatenate([b["image"] for b in read.eval_sets(config, ds)["blur_5"].eval_batches(64)])
  np.testing.assert_allclose(got, (blurred * 255.0 - mean) / std, atol=2e-4)
  ood = read.ood_sets(config, ds)
  assert list(ood) == ["digits", "photos"] and ood["digits"].test_size == ood["photos"].test_size == 64
  digit = next(ood["digits"].eval_batches(64))["image"]
  assert digit.shape == (64, 28, 28, 1)
  from sklearn.datasets import load_digits

  eight = load_digits().images[0] / 16.0  # the first digit, 8 x 8: each 3.5 x 3.5 block of the 28 x 28
  block = (digit[0, ..., 0] * std + mean) / 255.0
  np.testing.assert_allclose(block[1::7, 1::7][:4, :4], eight[::2, ::2][:4, :4], atol=0.2)


FLAGS = (
  "--config.num_epochs=0",
  "--config.num_train_steps=12",
  "--config.num_particles=4",
  "--config.num_cpu_devices=4",
  "--config.cnn_features=(8,16,32)",
  "--config.global_batch_size=64",
  "--config.checkpoint_every_steps=4",
  "--config.log_every_steps=1",
  "--config.eval_batch_size=1000",
  "--config.eval_shifts=contrast",
  "--config.shift_examples=100",
  "--config.ood_dataset=digits,photos",
  "--config.shuffle_buffer=2048",
  "--config.warmup_steps=2",
  "--config.bn_momentum=0.5",
)


def fashion_argv(workdir, data_dir):
  return [
    sys.executable,
    "train.py",
    "--config",
    "configs/fashion_mnist.py",
    "--workdir",
    str(workdir),
    f"--config.data_dir={data_dir}",
    *FLAGS,
  ]


def test_train_py_on_the_real_files_then_resume_mid_epoch_equals_uninterrupted(data_dir, tmp_path):
  """The config's command on the prepared files (12 steps, 4 particles): the final table, the shifted
  sets and both OOD sets; then a run stopped by SIGTERM mid-epoch and resumed ends bit for bit where
  the uninterrupted run ends (the TFDS stream skips the records of the steps already done)."""
  ref = tmp_path / "uninterrupted"
  r = subprocess.run(
    fashion_argv(ref, data_dir),
    cwd=helpers.ROOT,
    capture_output=True,
    text=True,
    timeout=600,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  assert "mesh (particle, data)=(4, 1) on 4 cpu device(s)" in r.stdout
  assert "final evaluation at step 12 on 10000 fashion_mnist test examples" in r.stdout
  for name in ("digits", "photos"):
    assert f"OOD AUROC ({name}), ensemble (weighted)" in r.stdout
  results = json.load(open(ref / "eval_results.json"))
  assert sorted(results["ood_sets"]) == ["digits", "photos"] and results["ood_dataset"] == "digits"
  assert sorted(results["shifts"]) == [f"contrast_{s}" for s in range(1, 6)]
  assert 0.18 < results["ensemble"]["accuracy"] <= 1.0  # 12 tiny steps: above chance (0.1); measured 0.24

  run = helpers.Running(fashion_argv(tmp_path / "resumed", data_dir))
  assert run.wait_for("step 6/12") is not None
  run.signal(signal.SIGTERM)
  rc, out = run.finish()
  assert rc == 143, out[-3000:]
  stopped = int(next(x for x in out.splitlines() if "stopped at step " in x).split("stopped at step ")[1].split()[0])
  assert 6 <= stopped < 12
  r2 = subprocess.run(
    fashion_argv(tmp_path / "resumed", data_dir),
    cwd=helpers.ROOT,
    capture_output=True,
    text=True,
    timeout=600,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert r2.returncode == 0, r2.stdout[-3000:] + r2.stderr[-3000:]
  assert f"at step {stopped}" in r2.stdout and "resumed from" in r2.stdout
  import jax

  jax.tree.map(
    np.testing.assert_array_equal,
    helpers.load_checkpoint_numpy(tmp_path / "resumed" / "checkpoints" / "12" / "state"),
    helpers.load_checkpoint_numpy(ref / "checkpoints" / "12" / "state"),
  )
  assert helpers.final_table(r2.stdout) == helpers.final_table(r.stdout)


def test_each_process_reads_its_part_of_a_shifted_set(data_dir, monkeypatch):
  """Two processes: each reads a near-equal part of a corrupted set, and the parts are the set one
  process reads (the corruption, drawn per image, is of the whole set on every process)."""
  import jax

  from configs import fashion_mnist

  config = fashion_mnist.get_config()
  config.data_dir, config.eval_shifts, config.shift_examples = data_dir, "gaussian_noise", 41
  ds = tfds_input.TFDSDataset("fashion_mnist", data_dir, image_size=28, small_images=True)
  whole = next(read.eval_sets(config, ds)["gaussian_noise_4"].eval_batches(100))
  parts = []
  for pid in (0, 1):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda pid=pid: pid)
    parts.append(next(read.eval_sets(config, ds)["gaussian_noise_4"].eval_batches(100)))
  assert [len(p["label"]) for p in parts] == [21, 20]
  for key in ("image", "label"):
    np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), whole[key])

"""The TFDS pipeline on tfds.testing.mock_data (no downloads), and train.py on imagenet_r50 shrunk."""

import os
import subprocess
import sys

import numpy as np
import pytest

from ipf_jax.data import tfds_input
from tests import helpers

pytestmark = pytest.mark.slow  # CI: leg 1 only (pytest.ini)
# tensorflow_datasets (the "tfds" extra, leg 1's install) is imported inside each test: leg 2, without it, collects
# this module to select by marks.

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name,small", [("imagenet2012", False), ("cifar10", True)])
def test_train_batches_are_deterministic_and_resumable(name, small):
  import tensorflow_datasets as tfds

  with tfds.testing.mock_data(num_examples=40):
    ds = tfds_input.TFDSDataset(name, None, image_size=16, shuffle_buffer=64, small_images=small)
    assert ds.num_train == 40 and ds.steps_per_epoch(8) == 5
    it = ds.train_batches(0, 8, seed=3)
    first = [next(it) for _ in range(7)]  # crosses the epoch boundary at step 5
    b = first[0]
    assert b["image"].shape == (8, 16, 16, 3) and b["image"].dtype == np.float32
    assert b["label"].shape == (8,) and b["label"].dtype == np.int32
    assert np.isfinite(b["image"]).all() and abs(float(b["image"].mean())) < 3
    again = list(zip(range(7), ds.train_batches(0, 8, seed=3)))
    for (_, x), y in zip(again, first):  # same seed, same stream
      np.testing.assert_array_equal(x["image"], y["image"])
    resumed = ds.train_batches(3, 8, seed=3)  # a run resumed at step 3 sees steps 3, 4, 5, 6
    for k in range(3, 7):
      got = next(resumed)
      np.testing.assert_array_equal(got["label"], first[k]["label"])
      np.testing.assert_allclose(got["image"], first[k]["image"], rtol=1e-6)
    epoch0 = np.concatenate([f["label"] for f in first[:5]])
    epoch1 = np.concatenate([next(ds.train_batches(5, 8, seed=3))["label"]])
    assert not np.array_equal(epoch0[:8], epoch1), "each epoch is shuffled anew"
    other = next(ds.train_batches(0, 8, seed=4))
    assert not np.array_equal(other["image"], first[0]["image"])


def test_resume_skips_records_without_decoding_them(monkeypatch):
  """A run resumed at step k of an epoch decodes about as many images before its first batch as a run
  starting at step 0 (not k batches more), and sees the batch an uninterrupted run sees at step k."""
  import tensorflow_datasets as tfds

  import tensorflow as tf

  decoded = []
  real = tfds_input.decode_image

  def counting(feature, encoded):
    n = tf.py_function(lambda: len(decoded.append(1) or decoded), [], tf.int32)
    n.set_shape(())
    image = real(feature, encoded)
    return image + tf.cast(n * 0, image.dtype)  # data-dependent, so the count runs with each decode

  monkeypatch.setattr(tfds_input, "decode_image", counting)
  with tfds.testing.mock_data(num_examples=640):
    ds = tfds_input.TFDSDataset("cifar10", None, image_size=16, shuffle_buffer=64, small_images=True)
    first = {}
    for start in (0, 60):  # 60 steps of 8 = 480 records skipped
      decoded.clear()
      first[start] = next(ds.train_batches(start, 8, seed=1))
      first[f"decoded {start}"] = len(decoded)
    assert 8 <= first["decoded 0"] and first["decoded 60"] < first["decoded 0"] + 64 < 480, first
    stream = ds.train_batches(0, 8, seed=1)
    uninterrupted = [next(stream) for _ in range(61)][60]
    np.testing.assert_array_equal(first[60]["label"], uninterrupted["label"])
    np.testing.assert_allclose(first[60]["image"], uninterrupted["image"], rtol=1e-6)


@pytest.mark.parametrize("name", ["imagenet2012", "cifar100"])
def test_eval_counts_every_example_once(name):
  import tensorflow_datasets as tfds

  with tfds.testing.mock_data(num_examples=23):
    ds = tfds_input.TFDSDataset(name, None, image_size=16, small_images=name != "imagenet2012")
    from ipf_jax.spmd import eval_step

    batches = list(eval_step.padded(ds.eval_batches(10), 10))  # what the evaluation feeds the eval step
    assert [len(b["label"]) for b in batches] == [10, 10, 10]
    assert sum(float(b["mask"].sum()) for b in batches) == ds.test_size == 23
    assert np.all(batches[-1]["mask"][3:] == 0) and np.all(batches[-1]["image"][3:] == 0)
    assert batches[0]["image"].shape == (10, 16, 16, 3)


@pytest.mark.parametrize("name,hint", [("imagenet2012", "downloads/manual"), ("cifar10", "tfds build cifar10")])
def test_missing_dataset_says_where_and_how(tmp_path, name, hint):
  with pytest.raises(tfds_input.DataError) as e:
    tfds_input.TFDSDataset(name, str(tmp_path), image_size=32)
  msg = str(e.value)
  assert f"{name!r} is not prepared in data_dir={tmp_path}" in msg and hint in msg


MOCK_TRAIN = """
import runpy, sys
import tensorflow_datasets as tfds
sys.argv = ["train.py"] + sys.argv[1:]
with tfds.testing.mock_data(num_examples=48):
  runpy.run_path("train.py", run_name="__main__")
"""


def test_train_py_imagenet_r50_shrunk_on_mock_data(tmp_path):
  flags = [
    "--config",
    "configs/imagenet_r50.py",
    "--workdir",
    str(tmp_path),
    "--config.model=resnet_tiny",
    "--config.image_size=16",
    "--config.num_particles=4",
    "--config.global_batch_size=16",
    "--config.num_epochs=0",
    "--config.num_train_steps=4",
    "--config.warmup_epochs=0",
    "--config.warmup_steps=1",
    "--config.eval_batch_size=8",
    "--config.num_cpu_devices=4",
    "--config.log_every_steps=1",
    "--config.eval_every_steps=0",
    "--config.shuffle_buffer=16",
    "--config.remat=True",
    "--config.label_smoothing=0.1",
    # orbax's commit of a checkpoint fails at random under mock_data's patching of file
    # access; checkpoints are tested on digits (tests/test_checkpoint.py)
    "--config.checkpoint_every_steps=-1",
  ]
  r = subprocess.run(
    [sys.executable, "-c", MOCK_TRAIN, *flags],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  fatal = r.stderr[r.stderr.find("Fatal Python error") :][:4000] if "Fatal Python error" in r.stderr else ""
  assert r.returncode == 0, r.stdout[-3000:] + (fatal or r.stderr[-3000:])  # an abort: its thread stacks
  assert "mesh (particle, data)=(4, 1) on 4 cpu device(s)" in r.stdout
  assert "step 4/4" in r.stdout
  assert "final evaluation at step 4 on 48 imagenet2012 test examples" in r.stdout
  assert "fused model" in r.stdout


def test_two_hosts_each_read_their_own_part_on_mock_data(tmp_path):
  """2 processes x 2 devices: each host reads its half of the training split and places only its
  devices' shards (``make_array_from_process_local_data``); process 0 reports on the whole eval split.
  The small CNN, not the ResNet (the run above): what is tested is the input's layout, not the model."""
  flags = [
    "--config",
    "configs/imagenet_r50.py",
    "--workdir",
    str(tmp_path),
    "--config.model=cnn",
    "--config.cnn_features=(4,8)",
    "--config.image_size=16",
    "--config.num_particles=4",
    "--config.particle_axis_size=2",
    "--config.global_batch_size=16",
    "--config.num_epochs=0",
    "--config.num_train_steps=3",
    "--config.warmup_epochs=0",
    "--config.warmup_steps=1",
    "--config.eval_batch_size=8",
    "--config.num_cpu_devices=2",
    "--config.log_every_steps=1",
    "--config.shuffle_buffer=16",
    "--config.checkpoint_every_steps=-1",
  ]  # see above: orbax under mock_data
  outs = helpers.run_processes([sys.executable, "-c", MOCK_TRAIN, *flags], 2)
  assert "mesh (particle, data)=(2, 2) on 4 cpu device(s), 2 process(es)" in outs[0]
  assert "step 3/3" in outs[0] and "final evaluation at step 3 on 48 imagenet2012 test examples" in outs[0]
  assert "final evaluation" not in outs[1]


def test_per_host_split_gives_each_process_its_half(monkeypatch):
  """With 2 processes, process k asks TFDS for the k-th of 2 even parts of the training split and
  gets G / 2 examples per step. (mock_data ignores split slicing, so the parts' contents cannot
  be told apart here; the 2-process run above checks the layout end to end.)"""
  import tensorflow_datasets as tfds

  import jax

  for pid in (0, 1):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda pid=pid: pid)
    with tfds.testing.mock_data(num_examples=40):
      ds = tfds_input.TFDSDataset("cifar10", None, image_size=16, shuffle_buffer=64, small_images=True)
      asked = []
      read = ds.builder.as_dataset

      def spy(split, **kwargs):
        asked.append(split)
        return read(split=split, **kwargs)

      monkeypatch.setattr(ds.builder, "as_dataset", spy)
      batch = next(ds.train_batches(0, 8, seed=0))
    assert batch["image"].shape == (4, 16, 16, 3) and batch["label"].shape == (4,)
    assert asked == [tfds.split_for_jax_process("train", process_index=pid, process_count=2, drop_remainder=True)]


def test_train_py_missing_imagenet_is_one_clear_error(tmp_path):
  r = subprocess.run(
    [
      sys.executable,
      "train.py",
      "--config",
      "configs/imagenet_r50.py",
      "--workdir",
      str(tmp_path / "w"),
      f"--config.data_dir={tmp_path}",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert r.returncode != 0
  assert "error: config.dataset: TFDS dataset 'imagenet2012' is not prepared" in r.stderr
  assert "Traceback" not in r.stderr

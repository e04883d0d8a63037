"""The benchmark scripts run end to end at a tiny size (no timing is asserted)."""

import json
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # CI: leg 1 only (pytest.ini)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_module(module, *args, devices=1, output=False):
  """The SUMMARY line's object of ``python -m module args`` on ``devices`` fake CPU devices (``output``: and
  its stdout)."""
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip(),
  )
  r = subprocess.run(
    [sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
  )
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  line = [x for x in r.stdout.splitlines() if x.startswith("SUMMARY ")][-1]
  summary = json.loads(line[len("SUMMARY ") :])
  return (summary, r.stdout) if output else summary


def test_gpu_resnet50_tiny_on_cpu(tmp_path):
  s = run_module(
    "benchmarks.gpu_resnet50",
    "--tiny",
    "--dtype",
    "float16",
    "--variants",
    "ddp,ipf L=2 map",
    "--trace",
    str(tmp_path),
    devices=2,
  )  # bf16: test_tfds
  assert s["devices"] == 2 and s["model"] == "resnet_tiny" and s["dtype"] == "float16"
  rows = {r["variant"]: r for r in s["rows"]}
  assert set(rows) == {"ddp", "ipf L=2 map"} and s["best_particle_loop_L2"] == "map"
  for r in rows.values():
    assert r["images_per_s"] > 0 and r["peak_MiB"] > 0 and r["compile_s"] > 0
  assert abs(rows["ipf L=2 map"]["vs ddp"] - rows["ipf L=2 map"]["images_per_s"] / rows["ddp"]["images_per_s"]) < 1e-9
  assert list(tmp_path.glob("ipf_L2_map/**/*.xplane.pb")), "a profiler trace was written"


def test_gpu_check_of_a_vit_takes_the_vit_recipe():
  """``--model vit_b16`` builds ViT-B/16 with ``configs/imagenet_vit_s16.py``'s recipe (AdamW, bfloat16 first
  moment, clipping, mixup) for every variant; nothing compiles here (a run on the CPU: ``--tiny --model vit``)."""
  import argparse

  import jax

  from benchmarks import gpu_resnet50

  args = argparse.Namespace(model="vit_b16", image_size=224, patch_size=0, dtype="bfloat16", per_device_batch=4)
  bench = gpu_resnet50.make("ipf L=2 map", args, jax.device_count())
  c = bench.config
  assert (c.model, c.optimizer, c.mu_dtype, c.grad_clip_norm, c.mixup) == ("vit_b16", "adamw", "bfloat16", 1.0, 0.2)
  assert c.num_particles == 2 * jax.device_count() and c.particle_loop == "map"
  kernel = bench.abstract.params["Transformer"]["encoderblock_0"]["MlpBlock_0"]["Dense_0"]["kernel"]
  assert kernel.shape == (c.num_particles, 768, 3072)  # ViT-B/16's MLP, per particle
  assert (
    gpu_resnet50.make(
      "ddp", argparse.Namespace(**{**vars(args), "model": "resnet50"}), jax.device_count()
    ).config.optimizer
    == "sgd"
  )


def test_memory_benchmark_tiny():
  s = run_module(
    "benchmarks.memory_resnet50",
    "--model",
    "resnet_tiny",
    "--image_size",
    "16",
    "--per_device_batch",
    "8",
    "--variants",
    "L=1,L=4",
  )
  peaks = s["peak_mib"]
  assert peaks["L=1"] > 0 and peaks["L=4"] > peaks["L=1"], "4 particles hold more state than 1"


def test_fsdp_memory_benchmark_tiny():
  s = run_module(
    "benchmarks.fsdp_memory",
    *("--models", "cnn", "--optimizers", "adamw", "--dds", "2", "--image_size", "8", "--per_device_batch", "1"),
    *("--min_size_mb", "0"),
  )
  whole, sharded = sorted(s["rows"], key=lambda r: r["fsdp"])
  assert (whole["dd"], sharded["dd"], whole["fsdp"], sharded["fsdp"]) == (2, 2, False, True)
  assert sharded["state_mib"] < 0.6 * whole["state_mib"], "the CNN's kernels are split over the 2 devices"
  assert sharded["collective_bytes"].get("all-gather", 0) > 0 and "all-gather" not in whole["collective_bytes"]
  assert sharded["peak_mib"] > 0 and whole["compile_s"] > 0


def test_precision_benchmark_tiny():
  s = run_module(
    "studies.precision_digits",
    "--seeds",
    "1",
    "--steps",
    "6",
    "--cnn_features",
    "4,8",
    "--variants",
    "float32;float16, scale 1",
    devices=8,
  )  # each dtype's step: tests/test_step.py
  rows = s["results"]
  assert set(rows) == {"float32", "float16, scale 1"}
  assert rows["float16, scale 1"]["final_loss_scale"] == 1.0 and "final_loss_scale" not in rows["float32"]
  assert all(0 <= r["fused_acc"] <= 1 and r["ens_nll"] > 0 for r in rows.values())


def test_fused_bn_benchmark_tiny():
  s = run_module(
    "studies.fused_bn_digits", "--seeds", "1", "--steps", "6", "--batches", "2", "--cnn_features", "4,8", devices=8
  )
  assert len(s["results"]) == 3
  assert all(0 <= r["fused_bn_acc"] <= 1 and r["fused_bn_nll"] > 0 for r in s["results"].values())


def test_exchange_buckets_benchmark_tiny():
  s = run_module("benchmarks.exchange_buckets", "--buckets", "1,auto", "--repeats", "1", "--rounds", "1", devices=4)
  assert set(s["over_ensemble"]) == {"ensemble", "rounds, bucket 1", "rounds, bucket auto"}
  assert s["devices"] == 4 and all(v > 0 for v in s["peak_mib"].values())


def test_placement_benchmark_tiny():
  """The round counts of both placements, and the step resampling every step with each, on 4 devices."""
  s = run_module(
    "benchmarks.placement",
    *("--meshes", "4x2", "--sigmas", "1", "--draws", "5", "--time", "--per_particle_batch", "2"),
    *("--repeats", "1", "--rounds", "1"),
    devices=4,
  )
  (row,) = s["rows"]
  assert (row["Dp"], row["L"]) == (4, 2) and row["across_ascending"] > 0 and row["across_local"] > 0
  assert [r["placement"] for r in s["steps"]] == ["ascending", "local"] and all(r["step_s"] > 0 for r in s["steps"])


def test_uncertainty_benchmark_tiny_with_a_calibration_set():
  method = "ipf correction=0 + islands=4 + init=independent (ess_threshold=0.9)"
  s = run_module(
    "studies.uncertainty_digits",
    "--seeds",
    "1",
    "--steps",
    "6",
    "--cnn_features",
    "4,8",
    "--methods",
    method,
    "--variants",
    "full",
    "--calibration_fraction",
    "0.1",
    "--uniform",
    devices=8,
  )
  row, seeds = s["results"][f"full / {method}"], s["per_seed"][f"full / {method}"]
  assert seeds == {k: [v] for k, v in row.items()} and 0 <= row["shift_uni_ece"] <= 1 and 0 < row["ood_auroc_uni"] <= 1
  assert s["calibration_fraction"] == 0.1 and 0.25 <= row["T"] <= 8
  assert 0 <= row["ens_ece_at_T"] <= 1 and 0 <= row["shift_ens_ece_at_T"] <= 1 and row["resamples"] == 6
  assert row["T"] != 1 and row["shift_ens_ece_at_T"] != row["shift_ens_ece"]  # T is applied to the shifted sets


def test_weigh_common_benchmark_tiny():
  tiny = ("--common_examples", "2", "--repeats", "1", "--rounds", "1")
  s = run_module("benchmarks.weigh_common", *tiny, devices=2)
  assert s["devices"] == 2 and set(s["flops_over_own"]) == {"own", "common, 2 per particle"}
  assert s["flops_over_own"]["common, 2 per particle"] > 1, "the common examples' forward pass costs FLOPs"
  assert all(v > 0 for v in s["time_over_own"].values()) and all(v > 0 for v in s["peak_over_own"].values())
  assert s["shape"] == [8, 8, 1], "the CNN's default: the digits' images"
  big = run_module("benchmarks.weigh_common", *tiny, "--shape", "16,16,1", devices=2)
  assert big["shape"] == [16, 16, 1]
  extra = "common, 2 per particle"
  # 4x the pixels: the extra forward pass's convolutions cost about 4x
  assert big["extra_gflop_per_device"][extra] > 2 * s["extra_gflop_per_device"][extra], (big, s)


def test_cpu_collectives_tiny():
  s = run_module("benchmarks.cpu_collectives", "--programs", "2", "--devices", "2", "--tries", "1")
  assert s["all_completed"] and s["tries"][0]["completed"] and s["programs"] == 2, s


def test_fashion_mnist_study_method_names_survive_the_comma_list():
  from studies import fashion_mnist

  from studies import fashion_mnist_finetune

  names = [*fashion_mnist.METHODS, *fashion_mnist_finetune.METHODS, *fashion_mnist_finetune.TRANSFER]
  assert not [m for m in names if "," in m], "--methods is a comma list: a name cannot hold one"


def test_fashion_mnist_study_s_small_vit_is_the_zoo_s_vit_resized():
  """``--vit W,D,H,P`` (study 5a): the zoo's ViT task for configs/fashion_mnist_vit.py (its dropout streams,
  stochastic depth, class token) at the size asked; the parameter count is a plain sum over the layers."""
  import jax
  import jax.numpy as jnp

  from studies import fashion_mnist
  from configs import fashion_mnist_vit

  config = fashion_mnist_vit.get_config()
  task = fashion_mnist.small_vit("16,2,2,7", config)
  assert (task.model.width, task.model.depth, task.model.num_heads, task.model.mlp_dim) == (16, 2, 2, 64)
  assert task.model.patch_size == 7 and task.model.stochastic_depth == config.stochastic_depth
  assert task.rngs and task.blocks == task.model.BLOCKS
  params = jax.eval_shape(task.init, jax.random.key(0), {"image": jnp.zeros((1, 28, 28, 1))})["params"]
  w, m, tokens = 16, 64, 4 * 4 + 1
  block = 2 * 2 * w + (3 * (w * w + w) + w * w + w) + (w * m + m + m * w + w)  # 2 LayerNorms, attention, MLP
  expected = (7 * 7 * w + w) + w + tokens * w + 2 * block + 2 * w + (w * 10 + 10)  # patches, cls, posemb, head
  assert sum(x.size for x in jax.tree.leaves(params)) == expected


def test_fashion_mnist_study_tiny(fashion_dir, tmp_path):
  out = tmp_path / "rows.jsonl"
  args = (
    "--data_dir",
    fashion_dir,
    "--seeds",
    "1",
    "--steps",
    "4",
    "--cnn_features",
    "4,8",
    "--shift_examples",
    "20",
    "--methods",
    "ipf ess_target=0.5",
    "--out",
    str(out),
    "--picture",
    str(tmp_path / "c.png"),
  )
  s = run_module("studies.fashion_mnist", *args, devices=8)
  (r,) = s["rows"]
  assert r["method"] == "ipf ess_target=0.5" and [json.loads(line) for line in open(out)] == [r]
  head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
  assert r["model"] == "cnn"
  if head.returncode:  # not a git checkout (an unpacked sdist): nothing to record
    assert r["commit"] == ""
  else:  # the code it ran
    assert re.fullmatch(r"[0-9a-f]{7,}\+?", r["commit"]) and r["commit"].rstrip("+") == head.stdout.strip(), r

  assert r["steps"] == 4 and r["curve"][-1] == [4, r["ens_acc"]] and 0 < r["ood_digits"] < 1
  assert 0 <= r["shift_ens_ece"] <= 1 and 0 < r["ood_photos"] < 1 and 0 <= r["resample_rate"] <= 1
  assert (tmp_path / "c.png").stat().st_size > 0
  again = run_module("studies.fashion_mnist", *args, "--resume", devices=8)  # its row is there: not rerun
  assert again["rows"] == [r]


def test_fashion_mnist_finetune_tiny(fashion_dir, tmp_path):
  """Both targets of the fine-tuning study run end to end: the transfer variant on the digits at 28 x 28 (new
  heads; no shifted or OOD sets, so no such columns; --epochs counting the 1,347 digits; --resume keyed by the
  target, without pre-training when nothing pre-trained is left to run) and the soup study on Fashion-MNIST."""
  common = ("--data_dir", fashion_dir, "--cnn_features", "4,8", "--shift_examples", "20")
  out = str(tmp_path / "rows.jsonl")
  methods = "ddp from scratch (no pre-training),deep ensemble of fine-tunes (fresh heads)"
  digits = (*common, "--target", "digits", "--epochs", "0.2", "--pre_epochs", "0.01", "--out", out)
  s, stdout = run_module("studies.fashion_mnist_finetune", *digits, "--methods", methods, devices=8, output=True)
  scratch, ensemble = s["rows"]
  assert (scratch["method"], ensemble["method"]) == tuple(methods.split(","))
  assert scratch["target"] == ensemble["target"] == "digits"
  assert scratch["steps"] == ensemble["steps"] == 2, "0.2 epochs of the 1,347 digits at batch 128 are 2 steps"
  assert len(scratch["particles_acc"]) == 1 and len(ensemble["particles_acc"]) == 8 and 0 < ensemble["pre_acc"] < 1
  assert ensemble["lr_factor"] == 1.0, "the digits' default: a new head trains at the config's learning rate"
  assert scratch["lr_factor"] is scratch["pre_epochs"] is None and "pre_acc" not in scratch, "scratch uses neither"
  assert ensemble["ood_digits"] is ensemble["shift_ens_acc"] is None  # those sets are Fashion-MNIST's
  assert ensemble["fused_nll"] != ensemble["single_nll"], "the fused row is the uniform soup, not the mean member"
  header = [line for line in stdout.splitlines() if line.startswith("| method")][0]
  assert "ens_acc" in header and "disagreement" in header and "ood_digits" not in header
  assert "(ddp from scratch (no pre-training): the config's learning rate and warmup)" in stdout

  # resumed with another pre-training: the scratch row is still this set-up's, the fine-tune's is not
  again, stdout = run_module(
    "studies.fashion_mnist_finetune",
    *digits[:-4],
    "--pre_epochs",
    "0.02",
    "--out",
    out,
    "--resume",
    "--methods",
    "ddp from scratch (no pre-training)",
    devices=8,
    output=True,
  )
  assert again["rows"] == [scratch] and "pre-trained" not in stdout, "nothing left to run: nothing pre-trained"

  s = run_module(
    "studies.fashion_mnist_finetune",
    *common,
    "--steps",
    "4",
    "--methods",
    "one fine-tune (ddp)",
    "--out",
    out,
    "--resume",
    devices=8,
  )
  (soup,) = s["rows"]
  assert soup["target"] == "fashion_mnist" and soup["steps"] == 4 and 0 < soup["ood_digits"] < 1
  assert soup["fused_acc"] == soup["ens_acc"] and soup["lr_factor"] == 0.1  # one model: its own fused model


def test_transfer_digits_reach_the_model_as_the_pipeline_feeds_fashion_mnist(fashion_dir):
  """``--target digits``' images are what the trainer's TFDS path makes of the same pixels (its eval
  preprocessing, as when it reads the digits as an OOD set of Fashion-MNIST): the scale pre-training saw."""
  import numpy as np

  from studies import fashion_mnist_finetune
  from ipf_jax.data import digits, tfds_input

  like = tfds_input.TFDSDataset("fashion_mnist", fashion_dir, image_size=28, small_images=True)
  plain, data = digits.load(28), fashion_mnist_finetune.transfer_data()
  for split in ("train", "test"):
    pixels = getattr(plain, split)["image"] * 255.0
    fed = tfds_input.ArrayEvalSet("digits", pixels, None, like).eval_batches(4096)
    np.testing.assert_allclose(getattr(data, split)["image"], np.concatenate([b["image"] for b in fed]), atol=1e-5)
    np.testing.assert_array_equal(getattr(data, split)["label"], getattr(plain, split)["label"])
  assert -1 < data.test["image"].mean() < 1, "normalised: near zero mean, not [0, 1] pixels"


def test_fashion_mnist_input_tiny(fashion_dir):
  s = run_module(
    "benchmarks.fashion_mnist_input",
    "--data_dir",
    fashion_dir,
    "--configs",
    "fashion_mnist",
    "--batches",
    "3",
    "--repeats",
    "1",
    "--rounds",
    "1",
    "--randaugment",
    "2,10",
    devices=8,
  )
  (row,) = s["rows"]
  assert row["model"] == "cnn" and row["pipeline_img_s"] > 0 and row["step_img_s"] > 0 and row["together_img_s"] > 0
  assert row["randaugment_img_s"] > 0


@pytest.mark.parametrize(
  "module,args,message",
  [
    ("benchmarks.fsdp_memory", ["--blocks", "--no-compile"], "--blocks compares the compiled step's peaks"),
    ("benchmarks.fsdp_memory", ["--live", "5"], "--live reads what sets the peaks --blocks compiles"),
    ("studies.fashion_mnist", ["--vit", "64,6,0,7"], "four positive integers"),
    ("studies.fashion_mnist", ["--vit", "64,6,4,7", "--cnn_features", "4,8"], "give one of them"),
    ("studies.fashion_mnist", ["--vit", "64,6,5,7"], "the width 64 must be a multiple of the heads 5"),
    ("studies.fashion_mnist", ["--vit", "64,6,4,8"], "the patch 8 must divide"),
  ],
)
def test_benchmark_arguments_that_cannot_run_are_refused(module, args, message):
  """One parser error (exit 2) naming what to change, before anything is built."""
  r = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]


def test_peak_live_names_the_buffers_alive_at_a_known_peak(tmp_path):
  """A program whose peak holds its input and three outputs of one shape, all at once (the outputs are the
  program's result): the tool finds those four and only buffers that fit beside them (scalars at most). Two
  programs share its name (``jit_f`` compiled twice) and a third carries a seven-element tuple through a loop
  (XLA writes ``/*index=5*/`` inside such a shape): each is read as its own."""
  from benchmarks import peak_live

  program = (
    "import jax, jax.numpy as jnp\n"
    "def f(a):\n"
    "  return a * 2.0, jnp.sin(a), jnp.exp(a)\n"
    "jax.block_until_ready(jax.jit(f)(jnp.ones((128, 64), jnp.float32)))\n"
    "jax.block_until_ready(jax.jit(f)(jnp.ones((16, 8), jnp.float32)))\n"
    "def g(x):\n"
    "  body = lambda i, c: tuple(v + i for v in c)\n"
    "  return jax.lax.fori_loop(0, 3, body, tuple(x * k for k in range(7)))\n"
    "jax.block_until_ready(jax.jit(g)(jnp.ones((32, 32), jnp.float32)))\n"
  )
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_dump_to={tmp_path}")
  r = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  found = peak_live.modules(str(tmp_path))
  twins = sorted(k for k in found if k.endswith(".jit_f"))
  assert len(twins) == 2, found
  sizes = []
  for name in twins:
    live, buffers = peak_live.live_at_peak(found[name])
    groups = {g["shape"]: g for g in peak_live.by_shape(buffers)}
    shape, nbytes = next((s, n) for s, n in (("f32[128,64]", 128 * 64 * 4), ("f32[16,8]", 16 * 8 * 4)) if s in groups)
    assert groups[shape]["count"] == 4, groups  # the input and the three outputs (a tuple's elements)
    assert groups[shape]["mib"] * 2**20 == 4 * nbytes
    assert live == sum(b["bytes"] for b in buffers) and live - 4 * nbytes < 64, "nothing else of size"
    assert {b["shape"] for b in buffers} <= {shape, "f32[]", f"({shape}, {shape}, {shape})"}
    sizes.append(shape)
  assert sorted(sizes) == ["f32[128,64]", "f32[16,8]"], "each compile read from its own files"
  with pytest.raises(KeyError, match="2 programs"):
    peak_live.find_module(str(tmp_path), "jit_f")
  assert peak_live.find_module(str(tmp_path), twins[0]) == found[twins[0]]
  _, loop = peak_live.live_at_peak(peak_live.find_module(str(tmp_path), "jit_g"))
  carried = [b for b in loop if b["shape"] == "f32[32,32]"]
  assert len(carried) >= 7 and not [b for b in loop if "/*" in b["shape"] or b["shape"] == "?"], loop
  first = peak_live.largest_module(str(tmp_path))
  assert peak_live.largest_module(str(tmp_path), exclude={first}) != first
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="xla_dump_to"):
    peak_live.largest_module(str(tmp_path / "empty"))


def test_remat_gather_toy_holds_fewer_kernels_when_each_layer_gathers_its_own():
  """The block-wise gather's mechanism, compiled: with the recomputation kept, the gradient of layers that
  gather their own kernels holds a few kernels whole at a time; gathered up front (one gather a kernel, as the
  library's), nearly every kernel, in both XLA settings."""
  s = run_module("benchmarks.remat_gather", "--layers", "8", "--width", "128", "--devices", "2")
  rows = s["rows"]
  assert set(rows) == {"defaults", "KEEP_REMAT"}
  assert all(r["up front"] >= 8 - 1 for r in rows.values()), rows
  assert rows["KEEP_REMAT"]["per layer"] < 0.7 * rows["KEEP_REMAT"]["up front"], rows

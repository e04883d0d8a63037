"""Shared pieces of the benchmarks: build a train step from a config, synthetic batches, timing."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from configs import digits
from ipf_jax.config import builder as build_lib
from ipf_jax.config import validation
from ipf_jax.spmd import layout


class Bench:
  """The run's parts (``build``) for ``config`` on this host's devices, with synthetic batches."""

  def __init__(self, config, image_shape, num_classes, spec_changes=None, exchange=None):
    self.config = config
    spec = validation.particle_spec(config)
    if spec_changes:  # e.g. {"resampling": False}: isolate one part of the step
      spec = dataclasses.replace(spec, **spec_changes)
    self.image_shape = tuple(image_shape)
    self.num_classes = num_classes
    example = {"image": np.zeros((1,) + self.image_shape, np.float32), "label": np.zeros((1,), np.int32)}
    self.parts = build_lib.build(config, build_lib.zoo_task(config, num_classes), example, spec=spec, exchange=exchange)
    self.mesh, self.spec, self.tx, self.abstract, self.init = (
      self.parts.mesh,
      self.parts.spec,
      self.parts.tx,
      self.parts.abstract_state,
      self.parts.init_state,
    )
    self.model = self.parts.task.model
    self.train_step = self.parts.train_step

  def synthetic_batch(self, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    g = self.config.global_batch_size
    batch = {
      "image": rng.normal(size=(g,) + tuple(self.image_shape)).astype(dtype),
      "label": rng.integers(0, self.num_classes, size=g).astype(np.int32),
    }
    return layout.put_train_batch(batch, self.config.num_particles, self.mesh)

  def batch_abstract(self):
    g, p = self.config.global_batch_size, self.config.num_particles
    shapes = {"image": ((p, g // p) + tuple(self.image_shape), jnp.float32), "label": ((p, g // p), jnp.int32)}
    return {
      k: jax.ShapeDtypeStruct(s, d, sharding=jax.sharding.NamedSharding(self.mesh, layout.TRAIN_BATCH_SPEC))
      for k, (s, d) in shapes.items()
    }

  def compiled(self):
    return self.train_step.lower(self.abstract, self.batch_abstract()).compile()


def config_for(args, **kw):
  """The digits config on ``args.model`` with ``args.per_particle_batch`` examples per particle, and ``kw``."""
  c = digits.get_config()
  c.sync = "step"  # the per-step filter these measure (the default, sync="auto", runs a population's outer loop)
  c.model, c.num_cpu_devices = args.model, 0
  c.global_batch_size = args.per_particle_batch * kw.get("num_particles", c.num_particles)
  for k, v in kw.items():
    c[k] = v
  return c


def image_shape(args):
  """The digits' 8 x 8 x 1 for the CNN, else ``args.image_size`` squared RGB."""
  return (8, 8, 1) if args.model == "cnn" else (args.image_size, args.image_size, 3)


class Timed:
  """A compiled train step with its state and one fixed batch."""

  def __init__(self, config, args, spec_changes=None, exchange=None, shape=None):
    self.bench = Bench(config, shape or image_shape(args), 10, spec_changes, exchange)
    self.state = self.bench.init()
    self.batch = self.bench.synthetic_batch()

  def __call__(self):
    self.state, m = self.bench.train_step(self.state, self.batch)
    return m["loss"]


def memory_mib(compiled) -> dict:
  """Per-device sizes from XLA's ``memory_analysis()`` in MiB;
  ``peak`` = arguments + outputs + temporaries - aliased."""
  m = compiled.memory_analysis()
  mib = lambda b: b / 2**20
  return {
    "arguments": mib(m.argument_size_in_bytes),
    "outputs": mib(m.output_size_in_bytes),
    "temporaries": mib(m.temp_size_in_bytes),
    "aliased": mib(m.alias_size_in_bytes),
    "peak": mib(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes),
  }


def median_time(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
  """Median wall time of ``fn()`` (blocked until ready) over ``repeats`` runs, after ``warmup`` runs."""
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def measure(variants: dict, repeats: int, rounds: int) -> dict:
  """Median seconds per call of each ``variants[name]()``, measured in alternating rounds
  so that drift on a shared machine hits every variant alike."""
  times = {k: [] for k in variants}
  for _ in range(rounds):
    for k, fn in variants.items():
      times[k].append(median_time(fn, repeats))
  return {k: float(np.median(v)) for k, v in times.items()}


def print_table(rows: list[dict], columns: list[str]) -> None:
  fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)
  widths = [max(len(c), *(len(fmt(r[c])) for r in rows)) for c in columns]
  print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
  for r in rows:
    print("  ".join(fmt(r[c]).ljust(w) for c, w in zip(columns, widths)))


def print_summary(summary: dict) -> None:
  print("SUMMARY " + json.dumps(summary, sort_keys=True))


def commit() -> str:
  """The checkout's commit (``+`` when its tracked files differ from it), or ``""`` outside a git checkout:
  what a row of a long study records of the code it ran."""
  here = os.path.dirname(os.path.abspath(__file__))
  git = lambda *a: subprocess.run(["git", "-C", here, *a], capture_output=True, text=True, timeout=30)
  try:
    head = git("rev-parse", "--short", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return ""
  return head.stdout.strip() + ("+" if dirty else "") if head.returncode == 0 else ""


def study_parser(doc: str, seeds: int = 3, methods: tuple = ()) -> argparse.ArgumentParser:
  """The digits studies' command line: ``--seeds``, ``--steps``, ``--cnn_features`` (and ``--methods``)."""
  parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--seeds", type=int, default=seeds)
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument(
    "--cnn_features",
    default="",
    help="e.g. 4,8: a smaller CNN than the digits config's (smoke runs; the tables use the config's)",
  )
  if methods:
    parser.add_argument("--methods", default=",".join(methods))
  return parser


def base_overrides(args) -> dict:
  """Config changes every run of a study gets from its command line."""
  return {"cnn_features": tuple(int(f) for f in args.cnn_features.split(","))} if args.cnn_features else {}


def digits_study(
  name: str,
  variants: dict,
  row: Callable[[dict, dict], dict],
  seeds: int,
  steps: int,
  columns: list[tuple[str, float, str]],
  note: str = "",
  base: dict | None = None,
) -> dict:
  """Trains the digits config once per (variant, seed) in this process and prints a markdown table
  of ``row(eval_results, tensorboard_scalars)`` (mean ± std over seeds; a column missing from a
  variant's rows shows "–") and ``SUMMARY {json}``. ``variants``: name -> config overrides;
  ``columns``: (key, scale, format); ``base``: overrides for every run. Returns ``{variant: {key: (mean, std)}}``."""
  import logging
  import os
  import tempfile

  from configs import digits
  from ipf_jax.reporting import report
  from ipf_jax.runtime import trainer

  logging.getLogger("ipf_jax").disabled = True
  table = {}
  with tempfile.TemporaryDirectory() as tmp:
    for variant, overrides in variants.items():
      runs = []
      for seed in range(seeds):
        config = digits.get_config()
        config.sync = "step"  # the per-step filter the variants change (sync="auto" would run the outer loop)
        config.seed, config.num_train_steps, config.log_every_steps = seed, steps, steps
        config.checkpoint_every_steps, config.num_cpu_devices = -1, 0
        for k, v in {**(base or {}), **overrides}.items():
          config[k] = v
        workdir = os.path.join(tmp, f"{len(table)}-{seed}")
        results = trainer.train_and_evaluate(config, workdir)
        runs.append(row(results, report.read_scalars(workdir)))
      table[variant] = {k: (float(np.mean([r[k] for r in runs])), float(np.std([r[k] for r in runs]))) for k in runs[0]}
      print(f"done {variant}", flush=True)
  print(
    f"\n{seeds} seeds, {steps} steps, digits config (8 particles, batch 128), mean ± std"
    + (f"; {note}" if note else "")
    + "\n"
  )
  print("| variant | " + " | ".join(c for c, _, _ in columns) + " |")
  print("|" + "---|" * (len(columns) + 1))
  for variant, r in table.items():
    cells = [f"{s * r[c][0]:{f}} ± {s * r[c][1]:{f}}" if c in r else "–" for c, s, f in columns]
    print(f"| {variant} | " + " | ".join(cells) + " |")
  print_summary(
    {
      "benchmark": name,
      "seeds": seeds,
      "steps": steps,
      "results": {v: {k: m for k, (m, _) in r.items()} for v, r in table.items()},
    }
  )
  return table

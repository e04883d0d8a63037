"""config.fsdp at pod scale, compile only on fake CPU devices: per-device state, peak memory and collective bytes.

  python -m benchmarks.fsdp_memory                                   # ViT-B/16, ViT-L/16, ResNet-50; Dd 1-8
  python -m benchmarks.fsdp_memory --models vit_b16 --dds 1,4 --optimizers adamw   # one row pair
  python -m benchmarks.fsdp_memory --time                             # step time, fsdp / whole (CPU)
  python -m benchmarks.fsdp_memory --blocks --models vit_b16 --dds 8   # remat: gathered per block or whole
  python -m benchmarks.fsdp_memory --blocks --models vit_b16 --dds 8 --live 10   # and what sets each peak
  python -m benchmarks.fsdp_memory --blocks --scan --models vit_b16 --dds 8  # the ViT's blocks as one nn.scan

P = 8 particles, one per group (Dp = 8, L = 1), each group ``Dd`` devices (8 x Dd fake devices, up to 64), so
a particle is replicated over its group (``fsdp`` off) or sharded over it (on, ``fsdp_min_size_mb`` default).
For each (model, optimizer, Dd, fsdp): the bytes of the particles' parameters and optimizer state on one device
(exact, from the state's shardings: nothing is allocated), and with ``--compile`` (default on) the train step
compiled for ``--per_device_batch`` images of ``--image_size``² per device: XLA's per-device peak
(``memory_analysis``), the compile time, and the bytes each device sends per collective kind in the compiled
HLO (``benchmarks.compression.collective_bytes``): ``all-gather`` and ``reduce-scatter`` are fsdp's own
(the forward's gather, the gradient's scatter); ``all-reduce`` holds the correction's consensus gradient
(and SyncBN's and the loss's small ones); ``collective-permute`` is the exchange's rounds, all of them as
compiled (a resampling runs only the rounds it needs). Each Dd runs in its own process (the fake device
count is fixed when JAX starts). ``--time``: the step's wall time, whole against fsdp, on 8 fake devices (the
digits CNN; a ratio inside one process). ``--blocks``: with ``remat`` and fsdp, the step whose model blocks
gather their own parameters (``fsdp_gather="block"``, ``models.blocks``) against the one that gathers the
whole particle up front (``"particle"``, the default), 2 particles on ``2 x Dd`` devices: peak and
temporaries per device under XLA:CPU's defaults and under ``KEEP_REMAT`` (``--no-resampling``: the step
without its resampling branch; ``--live K``: the K largest groups of buffers alive at each program's peak, by
shape, read from XLA's dump by ``benchmarks.peak_live``; ``--scan``: the ViTs' blocks as one ``nn.scan``,
``vit_scan``). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

OPTIMIZERS = {"adamw": dict(optimizer="adamw", base_lr=1e-3, weight_decay=0.05), "sgd": dict(optimizer="sgd")}


def state_bytes(abstract) -> int:
  """Bytes of the particles' parameters and optimizer state on one device (the shardings' shard shapes)."""
  import jax
  import numpy as np

  return sum(
    int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
    for x in jax.tree.leaves((abstract.params, abstract.opt_state))
  )


def child(model: str, optimizer: str, dd: int, args) -> list[dict]:
  """Both layouts of one (model, optimizer) on ``8 x dd`` fake devices (this process was started with them)."""
  from benchmarks.common import Bench, memory_mib
  from benchmarks.compression import collective_bytes
  from ipf_jax.config import defaults

  rows = []
  for fsdp in (False, True):
    if fsdp and dd == 1:  # one device per group: the rule shards nothing, the same program
      rows.append(dict(rows[0], fsdp=True))
      continue
    config = defaults.get_config()
    config.update(model=model, num_cpu_devices=0, num_particles=8, particle_axis_size=8, fsdp=fsdp, sync="step")
    config.vit_scan = args.scan
    config.update(global_batch_size=8 * dd * args.per_device_batch, dtype=args.dtype, **OPTIMIZERS[optimizer])
    if args.min_size_mb is not None:
      config.fsdp_min_size_mb = args.min_size_mb
    config.small_inputs = args.image_size <= 64 and model.startswith("resnet")
    row = {"model": model, "optimizer": optimizer, "dd": dd, "fsdp": fsdp}
    t = time.perf_counter()
    bench = Bench(config, (args.image_size, args.image_size, 3), 1000)
    row["state_mib"] = state_bytes(bench.abstract) / 2**20
    if args.compile:
      compiled = bench.compiled()
      row["compile_s"] = time.perf_counter() - t
      row["peak_mib"] = memory_mib(compiled)["peak"]
      row["collective_bytes"] = collective_bytes(compiled.as_text())
    rows.append(row)
  return rows


def timing(args) -> dict:
  """Seconds per step, whole particles and fsdp (every leaf the axis divides sharded), on this host's 8 fake
  devices as a ``(2, 4)`` mesh: the digits CNN, 8 particles, 16 examples each; measured in alternating rounds."""
  from benchmarks.common import Timed, config_for, measure

  variants = {}
  for fsdp in (False, True):
    config = config_for(
      args, num_particles=8, particle_axis_size=2, fsdp=fsdp, fsdp_min_size_mb=0.0, **OPTIMIZERS["adamw"]
    )
    variants["fsdp" if fsdp else "whole"] = Timed(config, args)
  seconds = measure(variants, args.repeats, args.rounds)
  return {"seconds": seconds, "fsdp / whole": seconds["fsdp"] / seconds["whole"]}


# XLA:CPU removes remat's optimization barriers and then merges a block's recomputed gather with its forward one
# (CSE), and its default scheduler favours concurrency over memory: together they keep every gathered block
# alive until the backward pass. These flags keep the recomputation (``benchmarks.remat_gather``: 8 layers of a
# toy, each gathering its kernel, hold 7.5 kernels of temporaries with the defaults and 2.8 with these; gathered
# up front, one gather a kernel, 7.5 with either).
KEEP_REMAT = "--xla_cpu_enable_concurrency_optimized_scheduler=false --xla_disable_hlo_passes=cse"


def blocks_child(model: str, optimizer: str, dd: int, args) -> list[dict]:
  """fsdp with remat on ``2 x dd`` devices (2 particles): the blocks gathered as they run, or the whole particle
  up front; this process's XLA flags are the caller's."""
  from benchmarks import peak_live
  from benchmarks.common import Bench, memory_mib
  from benchmarks.compression import collective_bytes
  from ipf_jax.config import defaults

  rows, read = [], set()
  for per_block in (True, False):
    config = defaults.get_config()
    config.update(
      model=model, num_cpu_devices=0, num_particles=2, particle_axis_size=2, fsdp=True, remat=True, sync="step"
    )
    config.vit_scan = args.scan
    config.fsdp_gather = "block" if per_block else "particle"
    config.update(global_batch_size=2 * dd * args.per_device_batch, dtype=args.dtype, **OPTIMIZERS[optimizer])
    if args.min_size_mb is not None:
      config.fsdp_min_size_mb = args.min_size_mb
    t = time.perf_counter()
    changes = None if args.resampling else {"resampling": False}
    bench = Bench(config, (args.image_size, args.image_size, 3), 1000, spec_changes=changes)
    compiled = bench.compiled()
    memory = memory_mib(compiled)
    gathered = collective_bytes(compiled.as_text()).get("all-gather", 0.0) / 2**20
    row = dict(model=model, optimizer=optimizer, dd=dd, per_block=per_block, compile_s=time.perf_counter() - t)
    row["scan"] = args.scan
    row["all_gather_mib"] = gathered
    row.update(peak_mib=memory["peak"], temp_mib=memory["temporaries"], state_mib=state_bytes(bench.abstract) / 2**20)
    if args.live:  # this process dumps to $IPF_JAX_DUMP (run_child): the program just compiled is its largest new one
      prefix = peak_live.largest_module(os.environ["IPF_JAX_DUMP"], exclude=read)
      read.add(prefix)
      live_bytes, buffers = peak_live.live_at_peak(prefix)
      row.update(live_mib=live_bytes / 2**20, live_buffers=len(buffers), live=peak_live.by_shape(buffers)[: args.live])
      row["live_module"] = os.path.basename(prefix)
    rows.append(row)
  return rows


def run_child(model: str, optimizer: str, dd: int, args, keep_remat: bool = False) -> list[dict]:
  devices = 2 * dd if args.blocks else 8 * dd
  flags = f"--xla_force_host_platform_device_count={devices}" + (f" {KEEP_REMAT}" if keep_remat else "")
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
  argv = [sys.executable, "-m", "benchmarks.fsdp_memory", "--child", model, optimizer, str(dd)]
  if args.live:
    with tempfile.TemporaryDirectory() as dump:
      env.update(IPF_JAX_DUMP=dump, XLA_FLAGS=f"{flags} --xla_dump_to={dump}")
      return run_argv(argv + [f"--live={args.live}"], env, args)
  return run_argv(argv, env, args)


def run_argv(argv: list[str], env: dict, args) -> list[dict]:
  argv += [f"--image_size={args.image_size}", f"--per_device_batch={args.per_device_batch}", f"--dtype={args.dtype}"]
  argv += [] if args.min_size_mb is None else [f"--min_size_mb={args.min_size_mb}"]
  argv += ["--blocks", f"--{'' if args.resampling else 'no-'}resampling"] if args.blocks else []
  argv += ["--scan"] if args.scan else []
  r = subprocess.run(argv + ([] if args.compile else ["--no-compile"]), env=env, capture_output=True, text=True)
  if r.returncode:
    raise RuntimeError(r.stderr[-3000:])
  return json.loads(r.stdout.strip().splitlines()[-1])


def print_table(rows: list[dict]) -> None:
  """One line per (model, optimizer, Dd): both layouts side by side, and fsdp's ratios to Dd = 1."""
  print(
    "\n| model | optimizer | Dd | state MiB/device, whole / fsdp | fsdp ÷ Dd=1 | peak MiB, whole / fsdp | "
    "all-gather + reduce-scatter MiB | all-reduce + collective-permute MiB, whole / fsdp | fsdp ÷ Dd=1 | "
    "compile s, whole / fsdp |"
  )
  print("|" + "---|" * 10)
  mib = lambda b: b / 2**20
  key = lambda r: (r["model"], r["optimizer"], r["dd"])
  by = {(key(r), r["fsdp"]): r for r in rows}
  population = lambda r: sum(r["collective_bytes"].get(k, 0.0) for k in ("all-reduce", "collective-permute"))
  for k in sorted({key(r) for r in rows}, key=lambda k: (k[0], k[1], k[2])):
    whole, sharded, one = by[k, False], by[k, True], by.get(((k[0], k[1], 1), True))
    state_ratio = f"{sharded['state_mib'] / one['state_mib']:.3f}" if one else ""
    line = f"| {k[0]} | {k[1]} | {k[2]} | {whole['state_mib']:.0f} / {sharded['state_mib']:.0f} | {state_ratio} | "
    if "peak_mib" in whole:
      own = sum(sharded["collective_bytes"].get(c, 0.0) for c in ("all-gather", "reduce-scatter"))
      ratio = f"{population(sharded) / population(one):.3f}" if one and population(one) else ""
      line += (
        f"{whole['peak_mib']:.0f} / {sharded['peak_mib']:.0f} | {mib(own):.0f} | "
        f"{mib(population(whole)):.0f} / {mib(population(sharded)):.0f} | {ratio} | "
        f"{whole['compile_s']:.0f} / {sharded['compile_s']:.0f} |"
      )
    else:
      line += "| | | | |"
    print(line)


def print_blocks(rows: list[dict]) -> None:
  """One line per (model, optimizer, Dd, XLA flags): per block against whole, and their ratio."""
  print(
    "\n| model | optimizer | Dd | XLA:CPU | peak MiB, per block / whole | ratio | temporaries MiB, per block / whole | "
    "all-gather MiB, per block / whole | state MiB |"
  )
  print("|" + "---|" * 9)
  name = lambda r: r["model"] + (" (scan)" if r.get("scan") else "")
  by = {(name(r), r["optimizer"], r["dd"], r["xla"], r["per_block"]): r for r in rows}
  for model, optimizer, dd, xla in sorted({(name(r), r["optimizer"], r["dd"], r["xla"]) for r in rows}):
    a, b = by[model, optimizer, dd, xla, True], by[model, optimizer, dd, xla, False]
    print(
      f"| {model} | {optimizer} | {dd} | {xla} | {a['peak_mib']:.0f} / {b['peak_mib']:.0f} | "
      f"{a['peak_mib'] / b['peak_mib']:.2f} | "
      f"{a['temp_mib']:.0f} / {b['temp_mib']:.0f} | {a['all_gather_mib']:.0f} / {b['all_gather_mib']:.0f} | "
      f"{a['state_mib']:.0f} |"
    )
  from benchmarks import peak_live

  for r in rows:
    if "live" in r:
      layout = "per block" if r["per_block"] else "whole"
      print(
        f"\n{r['model']} {r['optimizer']} Dd={r['dd']} {r['xla']}, {layout}: peak {r['peak_mib']:,.0f} MiB;", end=" "
      )
      peak_live.print_groups(r["live_mib"] * 2**20, r["live_buffers"], r["live"], len(r["live"]))


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--models", default="vit_b16,vit_l16,resnet50")
  parser.add_argument("--optimizers", default=None, help="default adamw,sgd; with --blocks adamw")
  parser.add_argument("--dds", default="1,2,4,8")
  parser.add_argument("--image_size", type=int, default=224)
  parser.add_argument("--per_device_batch", type=int, default=8)
  parser.add_argument("--dtype", default="float32")
  parser.add_argument("--min_size_mb", type=float, default=None, help="fsdp_min_size_mb (default: the config's)")
  parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
  parser.add_argument("--time", action="store_true", help="the step time instead (the digits CNN, 8 CPU devices)")
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--blocks", action="store_true", help="remat: the blocks gathered as they run, or whole")
  parser.add_argument(
    "--resampling", action=argparse.BooleanOptionalAction, default=True, help="--blocks: the step's resampling branch"
  )
  parser.add_argument("--scan", action="store_true", help="the ViTs' blocks as one nn.scan (vit_scan)")
  parser.add_argument("--live", type=int, default=0, help="--blocks: the K largest groups live at each peak")
  parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.blocks and not args.compile:
    parser.error("--blocks compares the compiled step's peaks: drop --no-compile")
  if args.live and not args.blocks:
    parser.error("--live reads what sets the peaks --blocks compiles: add --blocks")
  args.optimizers = args.optimizers or ("adamw" if args.blocks else "adamw,sgd")
  if args.time:
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
    from benchmarks.common import print_summary

    args.model, args.per_particle_batch = "cnn", 16
    result = timing(args)
    print(f"seconds per step: whole {result['seconds']['whole']:.4f}, fsdp {result['seconds']['fsdp']:.4f}")
    print_summary({"benchmark": "fsdp_time", **result})
    return
  if args.child:
    model, optimizer, dd = args.child
    rows = (blocks_child if args.blocks else child)(model, optimizer, int(dd), args)
    print(json.dumps(rows))
    return
  from benchmarks.common import print_summary

  if args.blocks:
    rows = []
    for model in args.models.split(","):
      for optimizer in args.optimizers.split(","):
        for dd in [int(x) for x in args.dds.split(",")]:
          for keep in (False, True):
            got = run_child(model, optimizer, dd, args, keep)
            got = [dict(r, xla="KEEP_REMAT" if keep else "defaults") for r in got]
            rows += got
            print(f"{model} {optimizer} Dd={dd}: " + ", ".join(json.dumps(r) for r in got), flush=True)
    print_blocks(rows)
    print_summary({"benchmark": "fsdp_blocks", "rows": rows})
    return

  rows = []
  for model in args.models.split(","):
    for optimizer in args.optimizers.split(","):
      for dd in [int(x) for x in args.dds.split(",")]:
        got = run_child(model, optimizer, dd, args)
        rows += got
        print(f"{model} {optimizer} Dd={dd}: " + ", ".join(json.dumps(r) for r in got), flush=True)
  print_table(rows)
  print_summary({"benchmark": "fsdp_memory", "rows": rows})


if __name__ == "__main__":
  main()

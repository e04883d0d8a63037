"""A pod-scale simulation of the ipf step, compile only, on fake CPU devices.

  python -m benchmarks.scaling                                   # cnn and resnet18 to Dp = 64, resnet50 to 16
  python -m benchmarks.scaling --models cnn --dps 1,2,8 --per_device 1   # a smoke run
  python -m benchmarks.scaling --models resnet18 --per_device 1 --dps 2,8,32 --dd 2 --fsdp   # fsdp, Dd = 2

For each model, P = Dp x L particles on Dp devices (L = 1 and 2 per device), the
train step is compiled three times: without the resampling branch, and with it
for each exchange (``all_to_all``: one collective of [Dp, L] blocks;
``rounds``: a loop over the rounds of one particle a resampling needs, each a
``lax.switch`` over Dp static ``ppermute`` shifts). Reported per device, from XLA's ``memory_analysis()`` and the
compiled HLO (bytes each device sends, as benchmarks/compression.py counts
them; a ``collective-permute`` sends its whole buffer): peak memory, the
step's collective bytes without resampling, the bytes one resampling moves when
1 and when P/2 particles are replaced (``rounds``: bytes of one round times the
rounds that resampling runs, averaged over 20 random replacements), and compile
time, and the number of collectives of each kind in the compiled step. ``--dd``
puts each particle group on that many devices (``Dp x Dd`` devices); ``--fsdp``
shards each particle over its group (``config.fsdp``, DESIGN.md §2). ``--counts``
compiles the step without resampling and with the rounds exchange only, and
prints the collectives of each kind and the compile seconds. Each device
count runs in its own process (the fake device count is fixed when JAX starts).
ResNets on 32 x 32 images (a CIFAR stem): the parameter and optimizer state is
the full model's; activations are small.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

DEFAULT_DPS = {"cnn": "1,2,4,8,16,32,64", "resnet18": "1,2,4,8,16,32,64", "resnet50": "1,4,16", "vit_b16": "8,64"}


def child(model: str, dp: int, per_device: int, exchange: str, dd: int = 1, fsdp: bool = False) -> dict:
  """One compile on ``dp x dd`` fake devices (this process was started with that many)."""
  import jax
  import numpy as np

  from benchmarks.common import Bench, memory_mib
  from benchmarks.compression import collective_bytes
  from ipf_jax.config import defaults
  from ipf_jax.population import exchange as exchange_lib

  config = defaults.get_config()
  config.sync = "step"  # the per-step filter's exchange
  config.model, config.num_cpu_devices, config.small_inputs = model, 0, True
  config.num_particles, config.particle_axis_size = dp * per_device, dp
  config.global_batch_size = dp * per_device * 8 * dd
  config.fsdp = fsdp
  config.resample_exchange = exchange if exchange != "none" else "all_to_all"
  shape, classes = ((8, 8, 1), 10) if model == "cnn" else ((32, 32, 3), 10)
  t = time.perf_counter()
  bench = Bench(config, shape, classes, {"resampling": False} if exchange == "none" else None)
  compiled = bench.compiled()
  compile_s = time.perf_counter() - t
  hlo = compiled.as_text()
  out = {
    "model": model,
    "dp": dp,
    "per_device": per_device,
    "exchange": exchange,
    "compile_s": compile_s,
    "peak_mib": memory_mib(compiled)["peak"],
    "collective_bytes": collective_bytes(hlo),
    "collectives": collective_counts(hlo),
    "dd": dd,
    "fsdp": fsdp,
    "particle_bytes": sum(
      int(np.prod(x.shape)) * x.dtype.itemsize
      for x in jax.tree.leaves((bench.abstract.params, bench.abstract.opt_state, bench.abstract.batch_stats))
    )
    // (dp * per_device),
  }
  if exchange == "rounds" and dp > 1:
    p = dp * per_device
    rng = np.random.default_rng(0)
    rounds = {}
    for k in (1, max(1, p // 2)):
      counts = []
      for _ in range(20):
        src = np.arange(p)
        slots = rng.choice(p, k, replace=False)
        src[slots] = rng.choice(np.setdiff1d(np.arange(p), slots), k)  # each replaced by a survivor
        counts.append(int(np.asarray(exchange_lib.active_rounds(src, per_device, dp))[1:].sum()))
      rounds[k] = float(np.mean(counts))
    out["rounds_run"] = rounds
  return out


def collective_counts(hlo: str) -> dict:
  """How many collectives of each kind the compiled HLO holds (a ``switch`` branch's count once; a combined
  collective, whose result is a tuple, once)."""
  from benchmarks.compression import COLLECTIVE

  out = {}
  for line in hlo.splitlines():
    m = COLLECTIVE.search(line)
    if m:
      out[m.group(2)] = out.get(m.group(2), 0) + 1
  return out


def run_child(model, dp, per_device, exchange, dd=1, fsdp=False):
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={dp * dd}")
  argv = [model, str(dp), str(per_device), exchange, str(dd), str(int(fsdp))]
  r = subprocess.run(
    [sys.executable, "-m", "benchmarks.scaling", "--child", *argv],
    env=env,
    capture_output=True,
    text=True,
  )
  if r.returncode:
    raise RuntimeError(r.stderr[-3000:])
  return json.loads(r.stdout.strip().splitlines()[-1])


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--models", default="cnn,resnet18,resnet50")
  parser.add_argument("--dps", default=None, help="device counts (default per model: %s)" % DEFAULT_DPS)
  parser.add_argument("--per_device", default="1,2")
  parser.add_argument("--dd", type=int, default=1, help="devices per particle group (Dp x Dd devices)")
  parser.add_argument("--fsdp", action="store_true", help="shard each particle over its group (config.fsdp)")
  parser.add_argument("--counts", action="store_true", help="only the collectives and compile time: none, rounds")
  parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    model, dp, per_device, exchange, dd, fsdp = args.child
    print(json.dumps(child(model, int(dp), int(per_device), exchange, int(dd), bool(int(fsdp)))))
    return
  from benchmarks.common import print_summary

  results = []
  exchanges = ("none", "rounds") if args.counts else ("none", "all_to_all", "rounds")
  for model in args.models.split(","):
    for per_device in [int(x) for x in args.per_device.split(",")]:
      for dp in [int(x) for x in (args.dps or DEFAULT_DPS[model]).split(",")]:
        row = {e: run_child(model, dp, per_device, e, args.dd, args.fsdp) for e in exchanges}
        results.append(row)
        print(
          f"compiled {model} Dp={dp} Dd={args.dd} fsdp={args.fsdp} L={per_device}: peak {'/'.join(exchanges)} = "
          + "/".join(f"{row[e]['peak_mib']:.1f}" for e in row)
          + " MiB",
          flush=True,
        )
  if args.counts:
    print_counts(results)
    return
  print(
    "\n| model | L | Dp | Dd | fsdp | particle MiB | peak MiB, no resampling | ÷, all_to_all | ÷, rounds | "
    "step collectives KiB | one resampling KiB, K=1: all_to_all / rounds | K=P/2: all_to_all / rounds | "
    "compile s (none / all_to_all / rounds) | compile ÷, rounds |"
  )
  print("|" + "---|" * 14)
  summary = []
  for row in results:
    none, a2a, rnd = row["none"], row["all_to_all"], row["rounds"]
    p_bytes = none["particle_bytes"]
    base = sum(none["collective_bytes"].values())
    a2a_bytes = sum(a2a["collective_bytes"].values()) - base  # the exchange: every resampling moves all of it
    # the loop's one round: a switch of Dp - 1 shifts across devices, each sending one particle
    per_round = rnd["collective_bytes"].get("collective-permute", 0.0) / max(1, none["dp"] - 1)
    rounds_run = rnd.get("rounds_run", {})
    k_half = max(1, none["dp"] * none["per_device"] // 2)
    r1, rh = per_round * rounds_run.get("1", 0.0), per_round * rounds_run.get(str(k_half), 0.0)  # JSON keys
    kib = lambda b: f"{b / 1024:.0f}"
    print(
      f"| {none['model']} | {none['per_device']} | {none['dp']} | {none['dd']} | {'on' if none['fsdp'] else 'off'} | "
      f"{p_bytes / 2**20:.1f} | "
      f"{none['peak_mib']:.1f} | "
      f"{a2a['peak_mib'] / none['peak_mib']:.2f} | {rnd['peak_mib'] / none['peak_mib']:.2f} | {kib(base)} | "
      f"{kib(a2a_bytes)} / {kib(r1)} | {kib(a2a_bytes)} / {kib(rh)} | {none['compile_s']:.0f} / "
      f"{a2a['compile_s']:.0f} / {rnd['compile_s']:.0f} | {rnd['compile_s'] / none['compile_s']:.2f} |"
    )
    summary.append(
      {
        "model": none["model"],
        "L": none["per_device"],
        "dp": none["dp"],
        "particle_bytes": p_bytes,
        "peak_none_mib": none["peak_mib"],
        "peak_ratio_all_to_all": a2a["peak_mib"] / none["peak_mib"],
        "peak_ratio_rounds": rnd["peak_mib"] / none["peak_mib"],
        "step_collective_bytes": base,
        "resample_bytes_all_to_all": a2a_bytes,
        "resample_bytes_rounds_k1": r1,
        "resample_bytes_rounds_khalf": rh,
        "compile_s": [none["compile_s"], a2a["compile_s"], rnd["compile_s"]],
        "dd": none["dd"],
        "fsdp": none["fsdp"],
        "collectives": [none["collectives"], rnd["collectives"]],
      }
    )
  print_summary({"benchmark": "scaling", "rows": summary})


def print_counts(results: list) -> None:
  """``--counts``: the collectives of each kind in the step without and with the rounds exchange."""
  from benchmarks.common import print_summary

  kinds = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute")
  print(
    "\n| model | L | Dp | Dd | fsdp | collectives, no resampling: "
    + " / ".join(kinds)
    + " | with rounds: "
    + " / ".join(kinds)
    + " | compile s (none / rounds) | ÷ |"
  )
  print("|" + "---|" * 9)
  for row in results:
    none, rnd = row["none"], row["rounds"]
    count = lambda r: " / ".join(str(r["collectives"].get(k, 0)) for k in kinds)
    print(
      f"| {none['model']} | {none['per_device']} | {none['dp']} | {none['dd']} | {'on' if none['fsdp'] else 'off'} | "
      f"{count(none)} | {count(rnd)} | {none['compile_s']:.0f} / {rnd['compile_s']:.0f} | "
      f"{rnd['compile_s'] / none['compile_s']:.2f} |"
    )
  print_summary({"benchmark": "scaling_counts", "rows": [{e: r[e] for e in ("none", "rounds")} for r in results]})


if __name__ == "__main__":
  main()

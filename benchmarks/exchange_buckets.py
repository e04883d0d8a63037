"""Bucket size of the rounds exchange: time and peak memory of a step that resamples every step.

  python -m benchmarks.exchange_buckets                 # 8 CPU devices (set below), digits CNN
  python -m benchmarks.exchange_buckets --buckets 1,65536,262144,4194304,auto

Each bucket size is one ``ppermute`` per bucket of a round (``exchange.buckets``): ``1`` puts every leaf
in its own (one collective per leaf), ``auto`` is the shipped default (a quarter of a particle, at
most ``exchange.BUCKET_BYTES``). Steps are ipf with ``resample_every=1`` (about 3 rounds per step at
P = 8 on 8 devices); medians of repeated steps in alternating rounds, each ÷ the ensemble step
measured in the same process; peak memory from ``memory_analysis()``.
"""

from __future__ import annotations

import argparse
import functools
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

from benchmarks.common import measure, memory_mib, print_summary, print_table  # noqa: E402
from benchmarks.common import Timed, config_for  # noqa: E402
from ipf_jax.population import exchange as exchange_lib  # noqa: E402


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="cnn")
  parser.add_argument("--image_size", type=int, default=32)
  parser.add_argument("--per_particle_batch", type=int, default=16)
  parser.add_argument("--buckets", default="1,65536,262144,4194304,auto")
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--rounds", type=int, default=5)
  args = parser.parse_args()
  p = jax.device_count()
  variants = {"ensemble": Timed(config_for(args, mode="ensemble", num_particles=p), args)}
  peaks = {"ensemble": memory_mib(variants["ensemble"].bench.compiled())["peak"]}
  for b in args.buckets.split(","):
    name = f"rounds, bucket {b}"
    exchange = (
      exchange_lib.exchange_rounds
      if b == "auto"
      else functools.partial(exchange_lib.exchange_rounds, bucket_bytes=int(b))
    )
    variants[name] = Timed(
      config_for(args, mode="ipf", num_particles=p, ess_threshold=0.0, resample_every=1), args, exchange=exchange
    )
    peaks[name] = memory_mib(variants[name].bench.compiled())["peak"]
  t = measure(variants, args.repeats, args.rounds)
  print_table(
    [{"variant": k, "step_ms": 1e3 * v, "vs ensemble": v / t["ensemble"], "peak_MiB": peaks[k]} for k, v in t.items()],
    ["variant", "step_ms", "vs ensemble", "peak_MiB"],
  )
  print_summary(
    {
      "benchmark": "exchange_buckets",
      "model": args.model,
      "devices": p,
      "over_ensemble": {k: v / t["ensemble"] for k, v in t.items()},
      "peak_mib": peaks,
    }
  )


if __name__ == "__main__":
  main()

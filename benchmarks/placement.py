"""Where the copies go (``resample_placement``): the rounds ``exchange_rounds`` runs, ascending against local.

  python -m benchmarks.placement                           # the round counts, 2 min
  python -m benchmarks.placement --time --model cnn        # and the step, resampling every step, 8 devices

A resampling's cost in the ``rounds`` exchange is its rounds: each round across devices (shift ``k > 0``)
sends one particle from every device; a round within a device (``k = 0``) copies one locally. For each
``(Dp, L)`` and spread of the log-weights (normal with std ``sigma``; ``--cull``: that fraction of the
particles culled in every other draw), ``--draws`` resamplings (``particle_filter.sources`` of the
weights, then ``place_local`` for ``local``), counted with the step's own ``exchange.active_rounds``: the
mean rounds across devices and within one, for each placement, and their ratio. ``place_local`` is a
``while_loop`` inside the step: its seconds per call (jitted, this host) at the largest ``P`` are printed.

``--time``: the ipf step with ``resample_every=1`` on ``--devices`` fake CPU devices, ``L = 2``, each
placement (medians of repeated steps in alternating rounds), and the rounds each ran; on fake CPU devices a
round across devices is a copy in one host's memory, so this measures the rounds' fixed costs, not a
network's.
"""

from __future__ import annotations

import argparse
import os
import sys

if "--time" in sys.argv:  # the step needs the fake devices before JAX starts
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import Timed, config_for, measure, median_time, print_summary, print_table  # noqa: E402
from ipf_jax.population import exchange as exchange_lib  # noqa: E402
from ipf_jax.population import particle_filter as pf  # noqa: E402


def rounds(src, num_local: int) -> tuple[int, int]:
  """(rounds across devices, rounds within one) that ``exchange_rounds`` runs for ``src``."""
  return tuple(int(x) for x in exchange_lib.count_rounds(jnp.asarray(src), num_local))


def count(dp: int, num_local: int, sigma: float, cull: float, draws: int, seed: int = 0) -> dict:
  """Mean rounds of each placement over ``draws`` resamplings."""
  p, rng = dp * num_local, np.random.default_rng(seed)
  sources = jax.jit(pf.sources, static_argnums=2)
  place = jax.jit(pf.place_local, static_argnums=(1, 2))
  got = {"ascending": [], "local": []}
  for i in range(draws):
    log_w = rng.normal(size=p) * sigma
    if cull and i % 2:
      log_w[rng.choice(p, max(1, int(cull * p)), replace=False)] = -np.inf
    src = sources(jnp.float32(rng.uniform()), pf.normalize(jnp.asarray(log_w, jnp.float32)), 1)
    got["ascending"].append(rounds(src, num_local))
    got["local"].append(rounds(place(src, num_local, 1), num_local))
  mean = {k: np.mean(v, axis=0) for k, v in got.items()}
  return {
    "Dp": dp,
    "L": num_local,
    "sigma": sigma,
    "cull": cull,
    "across_ascending": float(mean["ascending"][0]),
    "across_local": float(mean["local"][0]),
    "ratio": float(mean["local"][0] / max(mean["ascending"][0], 1e-9)),
    "within_ascending": float(mean["ascending"][1]),
    "within_local": float(mean["local"][1]),
  }


def place_seconds(p: int, num_local: int, repeats: int = 20) -> float:
  """Median seconds of one jitted ``place_local`` at ``P = p`` (a strongly uneven resampling)."""
  rng = np.random.default_rng(0)
  w = pf.normalize(jnp.asarray(rng.normal(size=p) * 2, jnp.float32))
  src = pf.sources(jnp.float32(0.5), w, 1)
  place = jax.jit(pf.place_local, static_argnums=(1, 2))
  return median_time(lambda: place(src, num_local, 1), repeats, warmup=1)


def time_steps(args) -> list[dict]:
  """The ipf step resampling every step with each placement, ``L = 2`` on the fake devices."""
  p = 2 * jax.device_count()
  kw = dict(mode="ipf", num_particles=p, resample_every=1, temperature=2.0, ess_threshold=0.0)
  steps = {
    name: Timed(config_for(args, resample_placement=name, resample_exchange="rounds", **kw), args)
    for name in pf.PLACEMENTS
  }
  seconds = measure(steps, args.repeats, args.rounds)
  rows = []
  for name, step in steps.items():
    ran = []
    for _ in range(10):  # the rounds its own resamplings ran
      step.state, m = step.bench.train_step(step.state, step.batch)
      ran.append(rounds(np.asarray(m["ancestors"]), 2))
    mean = np.mean(ran, axis=0)
    rows.append({"placement": name, "step_s": seconds[name], "across": float(mean[0]), "within": float(mean[1])})
  base = rows[0]["step_s"]
  for r in rows:
    r["step_ratio"] = r["step_s"] / base
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--meshes", default="8x1,8x2,8x4,16x4,64x1,64x2,256x1", help="Dp x L, comma separated")
  parser.add_argument("--sigmas", default="0.5,1,2")
  parser.add_argument("--cull", type=float, default=0.0)
  parser.add_argument("--draws", type=int, default=100)
  parser.add_argument("--time", action="store_true")
  parser.add_argument("--model", default="cnn")
  parser.add_argument("--image_size", type=int, default=32)
  parser.add_argument("--per_particle_batch", type=int, default=8)
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--rounds", type=int, default=5)
  args = parser.parse_args()
  meshes = [tuple(int(x) for x in m.split("x")) for m in args.meshes.split(",")]
  rows = [count(dp, n, float(s), args.cull, args.draws) for dp, n in meshes for s in args.sigmas.split(",")]
  print_table(
    rows, ["Dp", "L", "sigma", "cull", "across_ascending", "across_local", "ratio", "within_ascending", "within_local"]
  )
  biggest = max(meshes, key=lambda m: m[0] * m[1])
  seconds = place_seconds(biggest[0] * biggest[1], biggest[1])
  print(f"place_local at P = {biggest[0] * biggest[1]} (L = {biggest[1]}): {seconds * 1e3:.2f} ms a call")
  summary = {"benchmark": "placement", "rows": rows, "place_local_s": seconds, "place_local_p": biggest[0] * biggest[1]}
  if args.time:
    timed = time_steps(args)
    print_table(timed, ["placement", "step_s", "step_ratio", "across", "within"])
    summary["steps"] = timed
  print_summary(summary)


if __name__ == "__main__":
  main()

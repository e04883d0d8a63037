"""What the particle machinery costs, as ratios measured in one process (issue: performance).

  python -m benchmarks.overhead            # 8 CPU devices (set below), digits CNN
  python -m benchmarks.overhead --model resnet_tiny --image_size 32

All timings are medians of repeated steps after compilation; variants are
measured in alternating rounds so machine noise hits them alike. Prints a
table and ``SUMMARY {json}``.

1. ipf without a resample / ensemble (with and without the correction, with the
   elastic pull); ipf resampling every step / ensemble, with the digits config's
   resample-move noise (its jitter_lr) and without it, and without the correction
   (lambda = 0: the exchange's own cost); amortised over the digits run's measured
   resampling rate.
2. ddp (one particle) / a minimal hand-written jitted data-parallel step.
3. particles per device L = 1, 2, 4: per-example cost relative to L = 1, for
   vmap, lax.map and an unrolled loop.
4. peak memory (memory_analysis) of the ipf step / the ensemble step.
5. input pipeline images/s / train step images/s (digits).
6. the TFDS pipeline / the resnet_tiny step.
7. the outer loop (``config.sync``): its local step / an ensemble step, its sync step / an ensemble step, and
   the run amortised over a schedule's syncs (QSR on the digits run; ``--only outer``: this section alone).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from benchmarks.common import Timed, config_for, image_shape, measure, memory_mib, print_summary, print_table  # noqa: E402
from ipf_jax.data import digits as digits_data  # noqa: E402
from ipf_jax.config import read  # noqa: E402


def handwritten_ddp(config, args):
  """Minimal data-parallel step: jit over a batch sharded on every device, params replicated."""
  mesh = jax.make_mesh((jax.device_count(),), ("batch",), axis_types=(jax.sharding.AxisType.Explicit,))
  model = read.model(config, 10)
  tx = optax.sgd(0.01, momentum=0.9, nesterov=True)
  rep = NamedSharding(mesh, P())
  variables = jax.jit(
    lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1,) + image_shape(args)), train=False), out_shardings=rep
  )()
  params, stats = variables["params"], variables["batch_stats"]
  opt_state = jax.jit(tx.init, out_shardings=rep)(params)
  g = config.global_batch_size
  rng = np.random.default_rng(0)
  x = jax.device_put(rng.normal(size=(g,) + image_shape(args)).astype(np.float32), NamedSharding(mesh, P("batch")))
  y = jax.device_put(rng.integers(0, 10, g).astype(np.int32), NamedSharding(mesh, P("batch")))

  @jax.jit
  def step(params, stats, opt_state, x, y):
    def loss_fn(p):
      logits, new = model.apply({"params": p, "batch_stats": stats}, x, train=True, mutable=["batch_stats"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), new["batch_stats"]

    (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), stats, opt_state, loss

  box = [params, stats, opt_state]

  def run():
    *box[:], loss = step(*box, x, y)
    return loss

  return run


def digits_resample_rate(args):
  """Fraction of steps that resampled in the digits config's own run (measured, not assumed)."""
  c = config_for(args, num_train_steps=300)
  t = Timed(c, args)
  data = digits_data.load()
  from ipf_jax.spmd import layout

  resampled = 0
  for step in range(c.num_train_steps):
    batch = layout.put_train_batch(data.train_batch(step, c.global_batch_size, c.seed), c.num_particles, t.bench.mesh)
    t.state, m = t.bench.train_step(t.state, batch)
    resampled += int(m["resampled"])
  return resampled / c.num_train_steps


def outer_loop_costs(args, summary: dict) -> None:
  """Section 7: the outer loop's two programs against the ensemble's step, amortised over its schedule."""
  p = jax.device_count()
  ensemble = Timed(config_for(args, mode="ensemble", num_particles=p), args)
  qsr = Timed(config_for(args, mode="ipf", num_particles=p, sync="qsr", sync_every=4, ess_target=0.5), args)
  program = qsr.bench.train_step

  def local():
    qsr.state, m = program.local(qsr.state, qsr.batch)
    return m["loss"]

  def sync():
    qsr.state, m = program.sync(qsr.state, qsr.batch, program.pull)
    return m["loss"]

  t = measure({"ensemble": ensemble, "local": local, "sync": sync}, args.repeats, args.rounds)
  rate = float(np.mean(program.syncs))
  amortised = (1 - rate) * t["local"] + rate * t["sync"]
  rows = [
    {"variant": "outer loop, local step", "step_ms": 1e3 * t["local"], "vs ensemble": t["local"] / t["ensemble"]},
    {"variant": "outer loop, sync step", "step_ms": 1e3 * t["sync"], "vs ensemble": t["sync"] / t["ensemble"]},
    {
      "variant": f"outer loop amortised (qsr, {int(program.syncs.sum())} syncs in {len(program.syncs)} steps)",
      "step_ms": 1e3 * amortised,
      "vs ensemble": amortised / t["ensemble"],
    },
  ]
  print(f"\n7. The outer loop ({p} particles on {jax.device_count()} devices, {args.model}; ensemble step "
        f"{1e3 * t['ensemble']:.3f} ms)")  # fmt: skip
  print_table(rows, ["variant", "step_ms", "vs ensemble"])
  summary.update(
    outer_local_over_ensemble=t["local"] / t["ensemble"],
    outer_sync_over_ensemble=t["sync"] / t["ensemble"],
    outer_sync_rate=rate,
    outer_amortised_over_ensemble=amortised / t["ensemble"],
  )


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="cnn")
  parser.add_argument("--image_size", type=int, default=32)
  parser.add_argument("--per_particle_batch", type=int, default=16)
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--only", choices=("outer",), help="run one section alone")
  args = parser.parse_args()
  d = jax.device_count()
  summary = {"benchmark": "overhead", "devices": d, "backend": jax.default_backend(), "model": args.model}
  if args.only == "outer":
    outer_loop_costs(args, summary)
    return print_summary(summary)

  # 1. IPF vs ensemble; 4. memory of the same compiled steps.
  p = d
  variants = {
    "ensemble": Timed(config_for(args, mode="ensemble", num_particles=p), args),
    "ipf (no resample)": Timed(config_for(args, mode="ipf", num_particles=p, ess_threshold=0.0), args),
    "ipf lambda=0 (no resample)": Timed(
      config_for(args, mode="ipf", num_particles=p, ess_threshold=0.0, correction=0.0), args
    ),
    "ipf lambda=0, no resampling branch": Timed(
      config_for(args, mode="ipf", num_particles=p, correction=0.0), args, {"resampling": False}
    ),
    "ipf elastic 0.1 (no resample)": Timed(
      config_for(args, mode="ipf", num_particles=p, ess_threshold=0.0, elastic_pull=0.1), args
    ),
    "ipf (resample every step)": Timed(
      config_for(args, mode="ipf", num_particles=p, ess_threshold=0.0, resample_every=1), args
    ),
    "ipf (resample every step, jitter_lr=0)": Timed(
      config_for(args, mode="ipf", num_particles=p, ess_threshold=0.0, resample_every=1, jitter_lr=0.0), args
    ),
    "ipf lambda=0 (resample every step, jitter_lr=0)": Timed(
      config_for(args, mode="ipf", num_particles=p, ess_threshold=0.0, resample_every=1, jitter_lr=0.0, correction=0.0),
      args,
    ),
    "ipf (resample every step, all_to_all)": Timed(
      config_for(
        args, mode="ipf", num_particles=p, ess_threshold=0.0, resample_every=1, resample_exchange="all_to_all"
      ),
      args,
    ),
  }
  t = measure(variants, args.repeats, args.rounds)
  rate = digits_resample_rate(args)
  amortised = (1 - rate) * t["ipf (no resample)"] + rate * t["ipf (resample every step)"]
  mem = {k: memory_mib(v.bench.compiled())["peak"] for k, v in variants.items()}
  rows = [
    {"variant": k, "step_ms": 1e3 * v, "vs ensemble": v / t["ensemble"], "peak_MiB": mem[k]} for k, v in t.items()
  ]
  rows.append(
    {
      "variant": f"ipf amortised (resample rate {rate:.3f})",
      "step_ms": 1e3 * amortised,
      "vs ensemble": amortised / t["ensemble"],
      "peak_MiB": float("nan"),
    }
  )
  print(f"\n1. IPF overhead ({p} particles on {d} devices, {args.model})")
  print_table(rows, ["variant", "step_ms", "vs ensemble", "peak_MiB"])
  summary.update(
    ipf_no_resample_over_ensemble=t["ipf (no resample)"] / t["ensemble"],
    ipf_lambda0_no_resample_over_ensemble=t["ipf lambda=0 (no resample)"] / t["ensemble"],
    ipf_elastic_no_resample_over_ensemble=t["ipf elastic 0.1 (no resample)"] / t["ensemble"],
    ipf_resample_every_step_over_ensemble=t["ipf (resample every step)"] / t["ensemble"],
    ipf_resample_every_step_no_noise_over_ensemble=(t["ipf (resample every step, jitter_lr=0)"] / t["ensemble"]),
    ipf_lambda0_resample_every_step_no_noise_over_ensemble=(
      t["ipf lambda=0 (resample every step, jitter_lr=0)"] / t["ensemble"]
    ),
    ipf_resample_every_step_all_to_all_over_ensemble=(t["ipf (resample every step, all_to_all)"] / t["ensemble"]),
    digits_resample_rate=rate,
    ipf_amortised_over_ensemble=amortised / t["ensemble"],
    resampling_peak_memory_ratio=mem["ipf (resample every step)"] / mem["ensemble"],
    resampling_all_to_all_peak_memory_ratio=(mem["ipf (resample every step, all_to_all)"] / mem["ensemble"]),
  )

  # 2. DDP vs a hand-written data-parallel step.
  ddp_cfg = config_for(args, mode="ddp", num_particles=1, global_batch_size=args.per_particle_batch * d)
  t = measure(
    {"ddp (ipf_jax, P=1)": Timed(ddp_cfg, args), "hand-written jit DP": handwritten_ddp(ddp_cfg, args)},
    args.repeats,
    args.rounds,
  )
  print(f"\n2. DDP overhead ({args.per_particle_batch * d} examples per step on {d} devices)")
  print_table(
    [{"variant": k, "step_ms": 1e3 * v, "vs hand-written": v / t["hand-written jit DP"]} for k, v in t.items()],
    ["variant", "step_ms", "vs hand-written"],
  )
  summary["ddp_over_handwritten"] = t["ddp (ipf_jax, P=1)"] / t["hand-written jit DP"]

  # 3. Particles per device, three ways of looping over them.
  rows = []
  for loop in ("vmap", "map", "unroll"):
    variants = {
      n: Timed(config_for(args, mode="ensemble", num_particles=n * d, particle_loop=loop), args) for n in (1, 2, 4)
    }
    t = measure(variants, args.repeats, max(2, args.rounds // 2))
    for n, v in t.items():
      rows.append({"loop": loop, "L": n, "step_ms": 1e3 * v, "per-example vs L=1": (v / n) / t[1]})
      summary[f"per_example_L{n}_{loop}"] = (v / n) / t[1]
  print(f"\n3. Particles per device ({args.per_particle_batch} examples per particle; per-example cost vs L=1)")
  print_table(rows, ["loop", "L", "step_ms", "per-example vs L=1"])

  # 5. Input pipeline vs train step (digits).
  data = digits_data.load()
  c = config_for(args)
  n = 200
  t0 = time.perf_counter()
  for step in range(n):
    data.train_batch(step, c.global_batch_size, c.seed)
  input_rate = n * c.global_batch_size / (time.perf_counter() - t0)
  step_time = measure({"ipf": Timed(config_for(args), args)}, args.repeats, 2)["ipf"]
  train_rate = c.global_batch_size / step_time
  print(f"\n5. Input: digits host batches {input_rate:,.0f} images/s vs train step {train_rate:,.0f} images/s")
  summary.update(input_images_per_s=input_rate, train_images_per_s=train_rate, input_over_train=input_rate / train_rate)

  # 6. TFDS pipeline (tf.data on mock CIFAR-10, 32x32 crops) vs the resnet_tiny step at 32x32.
  import tensorflow_datasets as tfds

  from ipf_jax.data import tfds_input

  g = 8 * 16
  with tfds.testing.mock_data(num_examples=4096):
    ds = tfds_input.TFDSDataset("cifar10", None, image_size=32, shuffle_buffer=1024, small_images=True)
    it = ds.train_batches(0, g, seed=0)
    next(it)
    t0 = time.perf_counter()
    for _ in range(20):
      next(it)
    tfds_rate = 20 * g / (time.perf_counter() - t0)
  tiny = argparse.Namespace(**{**vars(args), "model": "resnet_tiny", "image_size": 32})
  tiny_time = measure({"ipf": Timed(config_for(tiny, global_batch_size=g), tiny)}, args.repeats, 2)["ipf"]
  print(
    f"6. Input: TFDS mock cifar10 pipeline {tfds_rate:,.0f} images/s vs resnet_tiny 32x32 train step "
    f"{g / tiny_time:,.0f} images/s"
  )
  summary.update(
    tfds_input_images_per_s=tfds_rate,
    tiny_train_images_per_s=g / tiny_time,
    tfds_input_over_train=tfds_rate * tiny_time / g,
  )
  outer_loop_costs(args, summary)
  print_summary(summary)


if __name__ == "__main__":
  main()

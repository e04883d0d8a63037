"""The block-wise gather's mechanism on a toy, under XLA:CPU's defaults and under ``KEEP_REMAT``.

  python -m benchmarks.remat_gather                       # 8 layers, 256 x 256 kernels over 4 devices
  python -m benchmarks.remat_gather --layers 12 --width 512

``fsdp_gather="block"`` rests on one mechanism: under remat, a layer that gathers its own sharded kernel as it
runs needs only that layer's kernel whole at a time (the backward pass gathers it again to recompute), where a
gather up front keeps every kernel whole until the backward pass has used it. This toy is that mechanism alone:
``--layers`` layers ``x = tanh(x @ w)``, each kernel ``--width`` x ``--width`` float32 sharded over ``--devices``
fake CPU devices (``shard_map``, ``all_gather`` over the axis), each layer under ``jax.checkpoint``; the gradient
of ``sum(x)`` compiled, and XLA's temporaries per device counted in whole kernels. Each XLA setting runs in its
own process (XLA reads its flags once). ``KEEP_REMAT`` is ``benchmarks.fsdp_memory``'s: without it XLA:CPU merges
a layer's recomputed gather with its forward one (CSE) and keeps more gathered kernels alive into the backward pass.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from benchmarks.fsdp_memory import KEEP_REMAT


def child(args) -> dict:
  """Temporaries per device, in kernels, of the gradient with the kernels gathered per layer or up front."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((args.devices,), ("d",))
  kernel_bytes = args.width * args.width * 4
  layer = jax.checkpoint(lambda x, w: jnp.tanh(x @ w))
  gather = lambda shard: jax.lax.all_gather(shard, "d", axis=0, tiled=True)

  def per_layer(shards, x):  # each layer gathers its own kernel inside the checkpointed region
    for i in range(args.layers):
      x = jax.checkpoint(lambda x, s: jnp.tanh(x @ gather(s)))(x, shards[i])
    return jnp.sum(x)

  def up_front(shards, x):  # every kernel gathered before the first layer, one gather each (as the library's)
    whole = [gather(shards[i]) for i in range(args.layers)]
    for i in range(args.layers):
      x = layer(x, whole[i])
    return jnp.sum(x)

  result = {}
  for name, loss in (("per layer", per_layer), ("up front", up_front)):
    grad = jax.shard_map(
      lambda s, x, loss=loss: jax.grad(loss)(s, x), mesh=mesh, in_specs=(P(None, "d"), P()), out_specs=P(None, "d")
    )
    shards = jax.device_put(
      np.zeros((args.layers, args.width, args.width), np.float32), NamedSharding(mesh, P(None, "d"))
    )
    x = jax.device_put(np.zeros((args.batch, args.width), np.float32), NamedSharding(mesh, P()))
    memory = jax.jit(grad).lower(shards, x).compile().memory_analysis()
    result[name] = memory.temp_size_in_bytes / kernel_bytes
  return result


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--width", type=int, default=256)
  parser.add_argument("--devices", type=int, default=4)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.width % args.devices:
    parser.error(f"--width {args.width} must be a multiple of --devices {args.devices} (each device a row block)")
  if args.child:
    print(json.dumps(child(args)))
    return
  from benchmarks.common import print_summary

  rows = {}
  for xla, extra in (("defaults", ""), ("KEEP_REMAT", f" {KEEP_REMAT}")):
    env = dict(
      os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={args.devices}{extra}"
    )
    argv = [sys.executable, "-m", "benchmarks.remat_gather", "--child"]
    argv += [f"--layers={args.layers}", f"--width={args.width}", f"--devices={args.devices}", f"--batch={args.batch}"]
    r = subprocess.run(argv, env=env, capture_output=True, text=True)
    if r.returncode:
      raise RuntimeError(r.stderr[-3000:])
    rows[xla] = json.loads(r.stdout.strip().splitlines()[-1])
  print(
    f"\n{args.layers} layers, {args.width}² float32 kernels over {args.devices} devices: "
    "temporaries per device, in kernels"
  )
  print("| XLA:CPU | gathered per layer | gathered up front |")
  print("|---|---|---|")
  for xla, r in rows.items():
    print(f"| {xla} | {r['per layer']:.1f} | {r['up front']:.1f} |")
  print_summary({"benchmark": "remat_gather", "layers": args.layers, "width": args.width, "rows": rows})


if __name__ == "__main__":
  main()

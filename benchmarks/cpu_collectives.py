"""Does XLA:CPU finish many collective programs in flight on fake CPU devices (docs/RUNNING.md "Known limits")?

  python -m benchmarks.cpu_collectives                  # 2,000 async psum programs on 8 devices, 3 tries

Each try is a child process that dispatches ``--programs`` jitted ``shard_map`` psums without waiting
(JAX's async dispatch), then waits for the last; a try that has not ended after ``--timeout`` seconds,
or that aborts (XLA's rendezvous gave up after about 60 s here), is a deadlock. The trainer waits for each
step on the CPU (``mesh.one_program_at_a_time``) because jaxlib 0.10.2 deadlocks here.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

CHILD = """
import sys, jax, jax.numpy as jnp
jax.config.update("jax_num_cpu_devices", {devices})
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh(({devices},), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "d") * 0.5, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
x = jax.device_put(jnp.ones(({devices}, 1024)), NamedSharding(mesh, P("d")))
for _ in range({programs}):
  x = f(x)  # not waited for: many programs with collectives in flight
jax.block_until_ready(x)
"""


def one_try(programs: int, devices: int, timeout: float) -> dict:
  start = time.monotonic()
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  try:
    r = subprocess.run(
      [sys.executable, "-c", CHILD.format(programs=programs, devices=devices)],
      env=env,
      capture_output=True,
      text=True,
      timeout=timeout,
    )
    completed, code = r.returncode == 0, r.returncode
    said = next((line for line in r.stderr.splitlines() if "rendezvous" in line), "")
  except subprocess.TimeoutExpired:
    completed, code, said = False, None, "no answer within the timeout"
  return {
    "completed": completed,
    "exit_code": code,
    "seconds": round(time.monotonic() - start, 2),
    "stderr": said[-300:],
  }


def main(argv=None):
  from benchmarks.common import print_summary

  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--programs", type=int, default=2000)
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--tries", type=int, default=3)
  parser.add_argument("--timeout", type=float, default=120.0)
  args = parser.parse_args(argv)
  import jax
  import jaxlib

  tries = [one_try(args.programs, args.devices, args.timeout) for _ in range(args.tries)]
  for k, t in enumerate(tries):
    print(
      f"try {k}: {'completed' if t['completed'] else 'DEADLOCK / abort'} in {t['seconds']} s "
      f"(exit code {t['exit_code']})"
    )
  print_summary(
    {
      "benchmark": "cpu_collectives",
      "jax": jax.__version__,
      "jaxlib": jaxlib.__version__,
      "python": sys.version.split()[0],
      "programs": args.programs,
      "devices": args.devices,
      "tries": tries,
      "all_completed": all(t["completed"] for t in tries),
    }
  )


if __name__ == "__main__":
  main()

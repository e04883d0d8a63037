"""Fault-injection campaign on the digits config, through train.py as a user runs it.

  python -m studies.faults                 # about 15 min on 2 cores
  python -m studies.faults --repeats 1 --kinds sigterm,sigkill   # a smoke run

Each fault hits a run at a random moment (seeded); the run is then rerun with
the same command until it finishes, and its final table and final state are
compared with an uninterrupted run's. Per kind: faults injected, runs that
ended identical, steps lost (the last step the interrupted run reported minus
the step the rerun resumed from), silent restarts (a rerun that started from
step 0 while checkpoints existed), and for a peer killed in a 2-process run the
seconds until the survivor exited.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import tempfile
import time

import jax
import numpy as np

from tests import helpers

STEPS, EVERY = 40, 10
FLAGS = (f"--config.num_train_steps={STEPS}", f"--config.checkpoint_every_steps={EVERY}", "--config.log_every_steps=1")
TWO_HOSTS = (
  "--config.num_particles=4",
  "--config.particle_axis_size=2",
  "--config.num_cpu_devices=2",
  "--peer_timeout=30",
)
KINDS = (
  "sigkill",
  "sigkill_saving",
  "sigterm",
  "sigint",
  "truncate",
  "delete",
  "concurrent",
  "config_change",
  "full_disk",
  "peer_killed",
)


def last_step(out: str) -> int:
  steps = [int(s) for s in re.findall(rf"step (\d+)/{STEPS}", out)]
  return max(steps, default=0)


def resumed_from(out: str) -> int:
  m = re.search(r"resumed from \S+ at step (\d+)", out)
  return int(m.group(1)) if m else 0


def finished(workdir, argv, outputs, limit=4):
  """Reruns ``argv`` until it exits 0 (at most ``limit`` times); appends each output."""
  for _ in range(limit):
    had_checkpoints = (
      any(d.isdigit() for d in os.listdir(os.path.join(workdir, "checkpoints")))
      if os.path.isdir(os.path.join(workdir, "checkpoints"))
      else False
    )
    run = helpers.Running(argv)
    rc, out = run.finish(timeout=600)
    outputs.append((out, had_checkpoints))
    if rc == 0:
      return out
  raise RuntimeError(f"{workdir} did not finish after {limit} reruns:\n{out[-2000:]}")


def same(workdir, out, reference) -> bool:
  ref_dir, ref_table = reference
  state = helpers.load_checkpoint_numpy(os.path.join(workdir, "checkpoints", str(STEPS), "state"))
  ref_state = helpers.load_checkpoint_numpy(os.path.join(ref_dir, "checkpoints", str(STEPS), "state"))
  equal = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state)))
  return equal and helpers.final_table(out) == ref_table


def interrupt(argv, at_step, sig, wait_text=None):
  """Starts ``argv``, sends ``sig`` when step ``at_step`` is reported; returns ``(rc, output)``."""
  run = helpers.Running(argv)
  if run.wait_for(wait_text or f"step {at_step}/{STEPS}") is not None:
    run.signal(sig)
  return run.finish(timeout=600)


def one_fault(kind, rng, base, reference, two_host_reference):
  """Injects one fault of ``kind``; returns the record of what happened."""
  workdir = tempfile.mkdtemp(dir=base, prefix=f"{kind}-")
  argv = helpers.train_py_argv(workdir, *FLAGS)
  k = rng.randint(2, STEPS - 2)
  record = {"kind": kind, "at_step": k}
  outputs = []
  if kind in ("sigkill", "sigkill_saving", "sigterm", "sigint"):
    if kind == "sigkill_saving":
      k = rng.choice(range(EVERY, STEPS, EVERY))  # the save of step k is in flight in the background
      record["at_step"] = k
    sig = {"sigterm": signal.SIGTERM, "sigint": signal.SIGINT}.get(kind, signal.SIGKILL)
    rc, out = interrupt(argv, k, sig)
    record["exit_code"] = rc
    reached = last_step(out)
  elif kind in ("truncate", "delete"):
    # After the first periodic save: the fault damages the newest checkpoint and the run falls back to the
    # one before. (Damage to a run's only checkpoint is refused, nothing moved and no start from step 0:
    # tests/test_durability.py.)
    k = record["at_step"] = max(k, EVERY + 1)
    rc, out = interrupt(argv, k, signal.SIGTERM)
    reached = last_step(out)
    newest = os.path.join(workdir, "checkpoints", str(reached))
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(newest) for f in fs)
    victim = rng.choice(files)
    record["damaged"] = os.path.relpath(victim, newest)
    if kind == "truncate":
      os.truncate(victim, os.path.getsize(victim) // 2)
    else:
      os.remove(victim)
  elif kind == "concurrent":
    first = helpers.Running(argv)
    first.wait_for("step 2/")
    second = helpers.Running(helpers.train_py_argv(workdir, *FLAGS, "--config.seed=1"))
    rc2, out2 = second.finish(timeout=300)
    record["second_refused"] = rc2 == 1 and "is in use by another run" in out2
    rc, out = first.finish(timeout=600)
    reached = last_step(out)
  elif kind == "config_change":
    rc, out = interrupt(argv, k, signal.SIGTERM)
    reached = last_step(out)
    before = sorted(os.listdir(os.path.join(workdir, "checkpoints")))
    changed = helpers.Running(helpers.train_py_argv(workdir, *FLAGS, "--config.cnn_features=(16,64,128)"))
    rc2, out2 = changed.finish(timeout=300)
    record["change_refused"] = (
      rc2 == 1
      and "does not fit this run's state" in out2
      and sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == before
    )
  elif kind == "full_disk":
    mount = os.path.join(workdir, "mnt")
    os.mkdir(mount)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=9m", "tmpfs", mount], capture_output=True).returncode:
      return None  # not permitted on this machine
    try:
      run = helpers.Running(helpers.train_py_argv(os.path.join(mount, "run"), *FLAGS))
      rc, out = run.finish(timeout=600)
      record["exit_code"] = rc
      record["one_line"] = (
        rc == 1 and "Traceback" not in out and len([x for x in out.splitlines() if x.startswith("error:")]) == 1
      )
      reached = last_step(out)
      shutil.copytree(os.path.join(mount, "run"), os.path.join(workdir, "run"))  # "free some space"
    finally:
      subprocess.run(["umount", mount], check=False)
    workdir = os.path.join(workdir, "run")
    argv = helpers.train_py_argv(workdir, *FLAGS)
  elif kind == "peer_killed":
    argv = helpers.train_py_argv(workdir, *FLAGS, *TWO_HOSTS)
    procs = helpers.start_processes(argv, 2)
    procs[0].wait_for(f"step {k}/{STEPS}")
    procs[1].signal(signal.SIGKILL)
    t0 = time.monotonic()
    rc, out = procs[0].finish(timeout=300)
    procs[1].finish(timeout=60)
    record["survivor_exit_s"] = round(time.monotonic() - t0, 1)
    record["exit_code"] = rc
    reached = last_step(out)
    port = helpers.free_port()
    for _ in range(3):  # both processes again until they finish
      procs = helpers.start_processes(argv, 2, port=port)
      results = [p.finish(timeout=600) for p in procs]
      outputs.append((results[0][1], True))
      if all(r == 0 for r, _ in results):
        break
      port = helpers.free_port()
    out = results[0][1]
    record.update(
      identical=same(workdir, out, two_host_reference), steps_lost=reached - resumed_from(out), silent_restarts=0
    )
    return record
  else:
    raise ValueError(kind)
  out = finished(workdir, argv, outputs)
  record["identical"] = same(workdir, out, reference)
  resumed = [resumed_from(o) for o, _ in outputs]
  record["steps_lost"] = max(0, reached - resumed[0])
  record["silent_restarts"] = sum(1 for o, had in outputs if had and "starting a new run" in o)
  return record


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--repeats", type=int, default=3, help="faults per kind")
  parser.add_argument("--kinds", default=",".join(KINDS))
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  rng = random.Random(args.seed)
  kinds = args.kinds.split(",")
  base = tempfile.mkdtemp(prefix="ipf_faults-")
  try:
    ref_dir = os.path.join(base, "reference")
    r = helpers.run_train_py(ref_dir, *FLAGS)
    assert r.returncode == 0, r.stderr
    reference = (ref_dir, helpers.final_table(r.stdout))
    two_host_reference = None
    if "peer_killed" in kinds:
      two_dir = os.path.join(base, "reference2")
      outs = helpers.run_processes(helpers.train_py_argv(two_dir, *FLAGS, *TWO_HOSTS), 2)
      two_host_reference = (two_dir, helpers.final_table(outs[0]))
    records = []
    for kind in kinds:
      for _ in range(args.repeats):
        rec = one_fault(kind, rng, base, reference, two_host_reference)
        if rec is not None:
          records.append(rec)
          print(json.dumps(rec), flush=True)
  finally:
    shutil.rmtree(base, ignore_errors=True)
  table = {}
  for kind in kinds:
    rows = [r for r in records if r["kind"] == kind]
    if not rows:
      continue
    table[kind] = {
      "injected": len(rows),
      "identical": sum(r["identical"] for r in rows),
      "max_steps_lost": max(r["steps_lost"] for r in rows),
      "silent_restarts": sum(r["silent_restarts"] for r in rows),
    }
    if kind == "peer_killed":
      table[kind]["max_survivor_exit_s"] = max(r["survivor_exit_s"] for r in rows)
  print("| fault | injected | ended identical | max steps lost | silent restarts |")
  print("|---|---|---|---|---|")
  for kind, t in table.items():
    extra = f" (survivor exited after ≤ {t['max_survivor_exit_s']} s)" if "max_survivor_exit_s" in t else ""
    print(f"| {kind}{extra} | {t['injected']} | {t['identical']} | {t['max_steps_lost']} | {t['silent_restarts']} |")
  print("SUMMARY " + json.dumps({"table": table, "records": records}))


if __name__ == "__main__":
  main()

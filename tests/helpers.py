"""Shared test fixtures: a tiny config, a mesh of a given shape, real digits batches."""

from __future__ import annotations

import functools
import os

import jax
import numpy as np
from jax.sharding import NamedSharding

from ipf_jax.config import builder as build_lib
from ipf_jax.config import defaults, validation
from ipf_jax.data import digits
from ipf_jax.config import read

PER_PARTICLE_BATCH = 8
MESH_SHAPES = [(8, 1), (4, 2), (2, 4), (1, 8)]  # (Dp, Dd) on the 8 fake devices


def sharded(mesh, x, spec):
  """``x`` placed on ``mesh`` as ``spec`` says (what ``shard_map``'s ``in_specs`` require of its inputs)."""
  return jax.device_put(x, NamedSharding(mesh, spec))


# Weights that part fast (tau = 4, rho = 0.8) and ESS < 0.9 P: resampling on most steps, with the correction and
# jitter on the copies. The reference tests' usual setting: ``tiny_config(**RESAMPLING, ...)``.
RESAMPLING = dict(temperature=4.0, forgetting=0.8, correction=0.5, ess_threshold=0.9, jitter=1e-3)


def tiny_config(**overrides):
  config = defaults.get_config()
  config.cnn_features = (4, 8)
  config.warmup_steps = 2
  config.num_train_steps = 20
  config.base_lr = 0.5
  config.init = "independent"  # distinct particles from step 0: every exchange is visible
  config.sync = "step"  # the per-step filter against tests/reference.py (the outer loop's tests set their sync)
  for k, v in overrides.items():
    config[k] = v
  return config


@functools.lru_cache(maxsize=None)
def digits_data():
  return digits.load()


def particle_batches(num_particles, num_steps, per_particle=PER_PARTICLE_BATCH, seed=0):
  """``num_steps`` batches ``(images [P, B, 8, 8, 1], labels [P, B])`` of real digits."""
  data = digits_data()
  g = num_particles * per_particle
  out = []
  for k in range(num_steps):
    b = data.train_batch(k, g, seed)
    out.append(
      (b["image"].reshape(num_particles, per_particle, 8, 8, 1), b["label"].reshape(num_particles, per_particle))
    )
  return out


class Setup:
  """The run's parts (``build``) for ``config`` on a ``(Dp, Dd)`` mesh, its initial state, and the plain
  model (no BatchNorm axis) for the reference."""

  def __init__(self, config, dp, dd, task=None, example=None):
    config.num_devices = dp * dd
    config.particle_axis_size = dp
    config.global_batch_size = config.num_particles * PER_PARTICLE_BATCH
    assert validation.validate(config, jax.device_count()) == (dp, dd)
    self.config = config
    self.task = task or build_lib.zoo_task(config, 10)
    self.parts = build_lib.build(config, self.task, example or digits_data().example)
    self.mesh, self.spec, self.tx, self.abstract = (
      self.parts.mesh,
      self.parts.spec,
      self.parts.tx,
      self.parts.abstract_state,
    )
    self.model = self.task.model
    self.plain_model = read.model(config, 10, bn_axis_name=None)
    self.state = self.parts.init_state()
    # One collective program in flight at a time on fake CPU devices (see mesh.one_program_at_a_time).
    self.train_step = lambda state, batch: jax.block_until_ready(self.parts.train_step(state, batch))

  def put(self, images, labels):
    from ipf_jax.spmd import layout

    return layout.put_sharded({"image": images, "label": labels}, layout.TRAIN_BATCH_SPEC, self.mesh)

  def evaluate(self, state, data, fused_bn=None):
    from ipf_jax.spmd import eval_step

    bs = self.config.eval_batch_size
    return eval_step.evaluate(
      self.task, self.parts.eval_step, state, data.eval_batches(bs), bs, self.mesh, fused_bn, jax.block_until_ready
    )

  def host_state(self):
    return jax.tree.map(np.array, jax.device_get(self.state))  # writable copies


def assert_close(actual, expected, rtol=2e-4, atol=2e-5, outliers=0.0, outlier_atol=0.0):
  """Trees equal within ``rtol`` and ``atol``. ``outliers``: up to that fraction of a leaf's entries may miss,
  if each is within ``outlier_atol * max|expected leaf|`` (rounding that scales with the leaf, not the entry)."""
  import chex

  actual, expected = jax.tree.map(np.asarray, actual), jax.tree.map(np.asarray, expected)
  if not outliers:
    chex.assert_trees_all_close(actual, expected, rtol=rtol, atol=atol)
    return
  chex.assert_trees_all_equal_structs(actual, expected)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(actual)[0], jax.tree.leaves(expected)):
    a, b = a.astype(np.float64), b.astype(np.float64)
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    missed = ~(np.abs(a - b) <= atol + rtol * np.abs(b))
    where = jax.tree_util.keystr(path)
    assert missed.mean() <= outliers, f"{where}: {missed.sum()} of {b.size} entries beyond rtol/atol"
    np.testing.assert_allclose(
      a[missed],
      b[missed],
      rtol=0,
      atol=outlier_atol * scale,
      err_msg=f"{where}: an entry beyond rtol/atol is beyond {outlier_atol:g} x its "
      f"leaf's largest magnitude {scale:.4g}",
    )


def load_checkpoint_numpy(path):
  """A saved state as numpy arrays, whatever mesh wrote it."""
  import orbax.checkpoint as ocp
  from jax.sharding import SingleDeviceSharding

  ckptr = ocp.StandardCheckpointer()
  tree = ckptr.metadata(path).item_metadata.tree
  dev = SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=dev), tree)
  return jax.tree.map(np.asarray, ckptr.restore(path, target))


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# train.py runs in the tests use a smaller CNN than the digits config's (32, 64, 128): 2.5x faster on 2 cores,
# and still 90% on digits after 60 steps. Tests of how well the config itself trains pass full_model=True.
TEST_FEATURES = (8, 16, 32)
TEST_CNN = f"--config.cnn_features=({','.join(map(str, TEST_FEATURES))})"


def train_py_argv(workdir, *flags, full_model=False):
  import sys

  small = [] if full_model or any(f.startswith("--config.cnn_features") for f in flags) else [TEST_CNN]
  return [sys.executable, "train.py", "--config", "configs/digits.py", "--workdir", str(workdir), *small, *flags]


def run_train_py(workdir, *flags, env=None, timeout=600, full_model=False, **kwargs):
  """``python train.py --config configs/digits.py --workdir WORKDIR FLAGS`` as a user runs it (``TEST_CNN``
  unless ``full_model``)."""
  import os
  import subprocess

  return subprocess.run(
    train_py_argv(workdir, *flags, full_model=full_model),
    cwd=ROOT,
    env=dict(os.environ, JAX_PLATFORMS="cpu", **(env or {})),
    capture_output=True,
    text=True,
    timeout=timeout,
    **kwargs,
  )


def kill_train_py_at(workdir, line: str, *flags) -> int:
  """``train.py`` on ``workdir`` with ``flags``, SIGKILLed when it prints a line containing ``line`` (bounded:
  the run ends by itself otherwise); its return code (``-SIGKILL`` when killed)."""
  import os
  import signal
  import subprocess

  proc = subprocess.Popen(
    train_py_argv(workdir, *flags),
    cwd=ROOT,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  try:
    for out in proc.stdout:
      if line in out:
        proc.send_signal(signal.SIGKILL)
        break
  finally:
    proc.kill()
    proc.wait(timeout=60)
  return proc.returncode


class Running:
  """A ``train.py`` (or any command) running in the background, its stdout+stderr read line by line."""

  def __init__(self, argv, env=None, **kwargs):
    import os
    import subprocess
    import threading

    self.lines = []
    self.proc = subprocess.Popen(
      argv,
      cwd=ROOT,
      env=dict(os.environ, JAX_PLATFORMS="cpu", **(env or {})),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      **kwargs,
    )
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self):
    for line in self.proc.stdout:
      self.lines.append(line)

  def wait_for(self, text, timeout=300):
    """Blocks until a line containing ``text`` appears (returns it) or the process ends (returns None)."""
    import time

    deadline = time.monotonic() + timeout
    seen = 0
    while time.monotonic() < deadline:
      while seen < len(self.lines):
        if text in self.lines[seen]:
          return self.lines[seen]
        seen += 1
      if self.proc.poll() is not None and seen == len(self.lines):
        self._reader.join(timeout=5)
        if seen == len(self.lines):
          return None
      time.sleep(0.02)
    raise TimeoutError(f"no line with {text!r} within {timeout} s:\n{self.output[-3000:]}")

  def signal(self, sig):
    self.proc.send_signal(sig)

  def finish(self, timeout=300):
    """Waits for the exit; returns ``(returncode, output)``."""
    try:
      self.proc.wait(timeout=timeout)
    finally:
      if self.proc.poll() is None:
        self.proc.kill()
        self.proc.wait(timeout=30)
    self._reader.join(timeout=10)
    return self.proc.returncode, self.output

  @property
  def output(self):
    return "".join(self.lines)


def final_table(out):
  """The rows of the final evaluation table in a run's output."""
  rest = out[out.index("final evaluation") :].split("\n", 1)[1]
  return "\n".join(
    line
    for line in rest.splitlines()
    if line and line[0] not in "0123456789" and not line.startswith(("error", "warning"))
  )


def free_port():
  import socket

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start_processes(argv, num_processes, port=None):
  """``argv`` once per process on localhost, joined by ``--coordinator_address/--num_processes/--process_id``;
  returns their ``Running`` handles."""
  port = port or free_port()
  return [
    Running(
      [*argv, f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={num_processes}", f"--process_id={pid}"]
    )
    for pid in range(num_processes)
  ]


def run_processes(argv, num_processes, timeout=600, expect=0):
  """``start_processes`` and wait; every process must exit with ``expect``. Returns their outputs."""
  procs = start_processes(argv, num_processes)
  results = [p.finish(timeout) for p in procs]
  for rc, out in results:
    assert rc == expect, out[-5000:]
  return [out for _, out in results]


def copy_checkout(dest):
  """The checkout's tracked and untracked-not-ignored files, copied to ``dest`` (a clean clone's tree)."""
  import os
  import shutil
  import subprocess

  files = subprocess.run(
    ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    check=True,
  )
  for f in files.stdout.split():
    if os.path.exists(os.path.join(ROOT, f)):
      os.makedirs(os.path.join(dest, os.path.dirname(f)), exist_ok=True)
      shutil.copyfile(os.path.join(ROOT, f), os.path.join(dest, f))
  return dest


def fresh_venv(venv):
  """A new virtualenv, as a user makes it, that sees this environment's packages (what ``pip install -r
  requirements.txt`` installed here) through a ``.pth`` file; returns its ``bin`` directory.

  ``--system-site-packages`` would not do: made from inside a virtualenv (``.ci/run`` makes one) it sees
  the base interpreter's packages, not this environment's. The venv's own bundled setuptools (65.5 on
  Python 3.11) is removed, as ``pip install -r requirements.txt`` would have upgraded it."""
  import os
  import site
  import subprocess
  import sys

  subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
  bin_dir = os.path.join(str(venv), "bin")
  py = os.path.join(bin_dir, "python")
  subprocess.run([py, "-m", "pip", "uninstall", "-q", "-y", "setuptools"], check=False, capture_output=True)
  inner = subprocess.run(
    [py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], capture_output=True, text=True, check=True
  ).stdout.strip()
  with open(os.path.join(inner, "outer_environment.pth"), "w") as f:
    f.write("\n".join(site.getsitepackages()) + "\n")
  return bin_dir


def venv_env(bin_dir):
  """The environment of a shell in ``fresh_venv``: its ``bin`` first on ``PATH``, no ``PYTHONPATH``, and pip
  offline (no index; the build uses this environment's setuptools; ``PIP_NO_BUILD_ISOLATION=0`` means
  "no build isolation", pip's reading of the variable)."""
  import os

  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
  return dict(
    env,
    PATH=bin_dir + os.pathsep + env.get("PATH", ""),
    JAX_PLATFORMS="cpu",
    PIP_NO_INDEX="1",
    PIP_NO_BUILD_ISOLATION="0",
    PIP_DISABLE_PIP_VERSION_CHECK="1",
    VIRTUAL_ENV=os.path.dirname(bin_dir),
  )


def saved_after_one_step(config, dp, dd, directory):
  """One train step of ``config`` on a ``(dp, dd)`` mesh, saved to ``directory``: ``(host state, images, labels)``."""
  from ipf_jax.runtime import checkpoint as checkpoint_lib

  src = Setup(config, dp, dd)
  images, labels = particle_batches(config.num_particles, 1)[0]
  src.state, _ = src.train_step(src.state, src.put(images, labels))
  saved = src.host_state()
  ckpt = checkpoint_lib.Checkpointer(str(directory), async_save=False)
  ckpt.save(1, src.state, config)
  ckpt.close()
  return saved, images, labels


def mark_slow(cases, *ids):
  """``cases`` (a parametrize list of tuples or values) with the cases whose pytest id is in ``ids`` (or that
  equal one of them: cases with dicts, whose ids pytest numbers) marked ``slow``: in a ``core`` module, the
  repetitions (another mesh or variant) that CI's second leg skips (pytest.ini). An id that names no case is
  an error here, so a renamed case cannot silently stay in the second leg."""
  import pytest

  def ident(case):
    return "-".join(str(v) for v in case) if isinstance(case, tuple) else str(case)

  known = [ident(c) for c in cases]
  missing = [i for i in ids if i not in known and i not in cases]
  assert not missing, f"mark_slow: {missing} are not among the cases {known}"
  marked = lambda c: ident(c) in ids or any(c == i for i in ids if not isinstance(i, str))
  return [pytest.param(*(c if isinstance(c, tuple) else (c,)), marks=pytest.mark.slow) if marked(c)
          else c for c in cases]  # fmt: skip

"""Shared test fixtures: a tiny config, a mesh of a given shape, real digits batches."""
from __future__ import annotations

import functools

import jax
import numpy as np

from configs import default
from ipf_jax import configuration
from ipf_jax import mesh as mesh_lib
from ipf_jax import optim
from ipf_jax import state as state_lib
from ipf_jax import step as step_lib
from ipf_jax.data import digits
from ipf_jax.models import create_model

PER_PARTICLE_BATCH = 8


def tiny_config(**overrides):
  config = default.get_config()
  config.cnn_features = (4, 8)
  config.warmup_steps = 2
  config.num_train_steps = 20
  config.base_lr = 0.5
  config.init = "independent"  # distinct particles from step 0: every exchange is visible
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
    out.append((b["image"].reshape(num_particles, per_particle, 8, 8, 1),
                b["label"].reshape(num_particles, per_particle)))
  return out


class Setup:
  """Model, optimizer, spec, mesh and initial state for ``config`` on a ``(Dp, Dd)`` mesh."""

  def __init__(self, config, dp, dd):
    devices = jax.devices()[:dp * dd]
    config.num_devices = dp * dd
    config.particle_axis_size = dp
    config.global_batch_size = config.num_particles * PER_PARTICLE_BATCH
    assert configuration.validate(config, jax.device_count()) == (dp, dd)
    self.config = config
    self.mesh = mesh_lib.make_mesh(config.num_particles, devices, dp)
    self.spec = configuration.particle_spec(config)
    self.model = create_model(config, 10, bn_axis_name=mesh_lib.DATA)
    self.plain_model = create_model(config, 10, bn_axis_name=None)
    total, warmup = optim.train_steps(config, steps_per_epoch=1)
    self.tx = optim.create_optimizer(config, optim.create_learning_rate_fn(config, total, warmup))
    self.abstract, init = state_lib.train_state_init_from_config(config, self.spec, self.model, self.tx, (8, 8, 1),
                                                                 self.mesh)
    self.state = init()
    step = step_lib.make_train_step(self.model, self.tx, self.spec, self.mesh, particle_loop=config.particle_loop)
    # One collective program in flight at a time on fake CPU devices (see trainer.one_program_at_a_time).
    self.train_step = lambda state, batch: jax.block_until_ready(step(state, batch))

  def put(self, images, labels):
    from ipf_jax.data import layout
    return layout.put_sharded({"image": images, "label": labels}, step_lib.BATCH_SPEC, self.mesh)

  def host_state(self):
    return jax.tree.map(np.array, jax.device_get(self.state))  # writable copies


def assert_close(actual, expected, rtol=2e-4, atol=2e-5):
  import chex
  chex.assert_trees_all_close(jax.tree.map(np.asarray, actual), jax.tree.map(np.asarray, expected),
                              rtol=rtol, atol=atol)


def load_checkpoint_numpy(path):
  """A saved state as numpy arrays, whatever mesh wrote it."""
  import orbax.checkpoint as ocp
  from jax.sharding import SingleDeviceSharding
  ckptr = ocp.StandardCheckpointer()
  tree = ckptr.metadata(path).item_metadata.tree
  dev = SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=dev), tree)
  return jax.tree.map(np.asarray, ckptr.restore(path, target))


def run_train_py(workdir, *flags, env=None, timeout=600):
  """``python train.py --config configs/digits.py --workdir WORKDIR FLAGS`` as a user runs it."""
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return subprocess.run([sys.executable, "train.py", "--config", "configs/digits.py", "--workdir", str(workdir),
                         *flags], cwd=root, env=dict(os.environ, JAX_PLATFORMS="cpu", **(env or {})),
                        capture_output=True, text=True, timeout=timeout)


def free_port():
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_processes(argv, num_processes, timeout=600):
  """``argv`` once per process on localhost, joined by ``--coordinator_address/--num_processes/
  --process_id``; every process must exit 0. Returns their outputs (stdout + stderr)."""
  import os
  import subprocess
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  port = free_port()
  procs = [subprocess.Popen([*argv, f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={num_processes}",
                             f"--process_id={pid}"], cwd=root, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for pid in range(num_processes)]
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=timeout)[0])
  finally:
    for p in procs:
      p.kill()
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-5000:]
  return outs

"""``config.num_cpu_devices`` as a user meets it: in a fresh Python process, without the 8 devices that
``tests/conftest.py`` forces on this one, on every entry path (``train_and_evaluate``, ``build``,
``train.py``); and one clear error when the caller started JAX's backend with another count."""

import os
import subprocess
import sys
import textwrap

import pytest

from tests import helpers

pytestmark = pytest.mark.core  # CI: every leg (pytest.ini)

PRELUDE = """
import jax, numpy as np, ipf_jax
from sklearn.datasets import load_digits
x, y = load_digits(return_X_y=True)
x, y = (x / 16.0).reshape(-1, 8, 8, 1).astype(np.float32), y.astype(np.int32)
data = ipf_jax.ArrayDataset("digits", train={"image": x[:1400], "label": y[:1400]},
                            test={"image": x[1400:], "label": y[1400:]}, num_classes=10)
config = ipf_jax.default_config()
config.model, config.cnn_features = "cnn", (4, 8)
config.num_particles, config.global_batch_size, config.num_train_steps, config.warmup_steps = 4, 32, 2, 1
config.checkpoint_every_steps = -1
"""


def _python(code: str, tmp_path, timeout=600, **env_vars):
  """``code`` after ``PRELUDE`` in a fresh interpreter (the checkout importable, nothing forced)."""
  env = dict(os.environ, PYTHONPATH=helpers.ROOT, JAX_PLATFORMS="cpu", **env_vars)
  return subprocess.run(
    [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )


def test_train_and_evaluate_applies_num_cpu_devices(tmp_path):
  r = _python(
    """
      config.num_cpu_devices = 4
      ipf_jax.train_and_evaluate(config, "run", data=data)
      print("devices", jax.device_count())
      """,
    tmp_path,
  )
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
  assert "mesh (particle, data)=(4, 1) on 4 cpu device(s)" in r.stdout and "devices 4" in r.stdout, r.stdout


def test_build_applies_num_cpu_devices(tmp_path):
  r = _python(
    """
      config.num_cpu_devices, config.num_particles = 2, 2
      from ipf_jax.config import read
      parts = ipf_jax.build(config, ipf_jax.classification(read.model(config, 10)), data.example)
      print("mesh", dict(parts.mesh.shape), "devices", jax.device_count())
      """,
    tmp_path,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  assert "mesh {'particle': 2, 'data': 1} devices 2" in r.stdout, r.stdout


def test_a_backend_started_with_another_count_is_one_clear_error(tmp_path):
  r = _python(
    """
      jax.devices()  # the caller starts JAX's backend (1 CPU device) before the run
      config.num_cpu_devices = 4
      try:
        ipf_jax.train_and_evaluate(config, "run", data=data)
      except ValueError as e:
        print("refused:", type(e).__name__, e)
      import os
      print("workdir created:", os.path.exists("run"))
      """,
    tmp_path,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  assert "refused: ConfigError config.num_cpu_devices: asks for 4 CPU devices" in r.stdout, r.stdout
  assert "with 1," in r.stdout and "workdir created: False" in r.stdout, r.stdout


def test_a_backend_started_with_the_same_count_is_used(tmp_path):
  r = _python(
    """
      jax.config.update("jax_num_cpu_devices", 4)
      jax.devices()
      config.num_cpu_devices = 4
      ipf_jax.train_and_evaluate(config, "run", data=data)
      """,
    tmp_path,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  assert "on 4 cpu device(s)" in r.stdout, r.stdout


def test_a_backend_started_by_xla_flags_with_the_same_count_is_used(tmp_path):
  """JAX's own setting stays unset when XLA_FLAGS made the devices: the count there is what decides."""
  flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
  r = _python(
    """
      jax.devices()
      config.num_cpu_devices = 4
      ipf_jax.train_and_evaluate(config, "run", data=data)
      """,
    tmp_path,
    XLA_FLAGS=flags,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  assert "on 4 cpu device(s)" in r.stdout, r.stdout

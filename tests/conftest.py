"""All tests run on 8 fake CPU devices, compiled at LLVM optimisation level 0 (below).

Compiled programs are shared through JAX's persistent compilation cache (one
fresh directory per test session, inherited by the train.py subprocesses): many
tests compile the same digits step, and a cache hit replaces a compile.
"""

import os
import subprocess
import sys
import tempfile

import pytest

os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="ipf_jax_tests_cache-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# The tests compile far more than they run: XLA's CPU backend at LLVM optimisation level 0 compiles the
# same programs in about half the time (tests/test_step.py's reference cases: 130 s -> 56 s). Results
# differ from level 2 only by float rounding, which the float32 comparisons with a reference tolerate;
# bit-for-bit comparisons (resumed vs uninterrupted) run both sides under this same flag. Float16's
# rounding differs more (the emulated half precision rounds where LLVM keeps or drops conversions): tests
# marked ``full_optimisation`` run in a child pytest process at the default level instead.
FAST_COMPILE = "--xla_backend_optimization_level=0"
IN_CHILD = os.environ.get("IPF_JAX_TESTS_CHILD") == "1"
if not IN_CHILD:
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + FAST_COMPILE).strip()

import jax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")


def pytest_configure(config):
  config.addinivalue_line(
    "markers",
    "full_optimisation: run in a child pytest process compiled at XLA's default "
    "LLVM optimisation level (comparisons whose float16 rounding depends on it)",
  )


CI_MARKS = ("core", "slow")  # pytest.ini: every test carries one (its module's pytestmark, or its own)


def pytest_runtest_setup(item):
  """A test that carries neither ``core`` nor ``slow`` fails (CI's first leg runs every test): CI's legs are
  chosen by these marks (``.ci/run``), so an unmarked test would belong to no leg but the first."""
  if not any(item.get_closest_marker(m) for m in CI_MARKS):
    pytest.fail(
      f"{item.nodeid} carries neither of the marks {' nor '.join(CI_MARKS)}: give its module a pytestmark = "
      "pytest.mark.core (every CI leg) or pytest.mark.slow (leg 1 only), see pytest.ini",
      pytrace=False,
    )


def pytest_pyfunc_call(pyfuncitem):
  """A ``full_optimisation`` test runs in a child pytest process without ``FAST_COMPILE``."""
  if IN_CHILD or pyfuncitem.get_closest_marker("full_optimisation") is None:
    return None
  flags = os.environ.get("XLA_FLAGS", "").replace(FAST_COMPILE, "").strip()
  r = subprocess.run(
    [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", pyfuncitem.nodeid],
    cwd=pyfuncitem.config.rootpath,
    capture_output=True,
    text=True,
    timeout=900,
    env=dict(os.environ, IPF_JAX_TESTS_CHILD="1", XLA_FLAGS=flags),
  )
  if r.returncode != 0:
    import pytest

    pytest.fail(f"in a child process at full optimisation:\n{r.stdout[-6000:]}{r.stderr[-2000:]}", pytrace=False)
  return True


FASHION_MNIST_DIR_ENV = "IPF_JAX_FASHION_MNIST_DIR"  # .ci/run prepares Fashion-MNIST there once (README command)


@pytest.fixture(scope="session")
def fashion_dir(tmp_path_factory):
  """A TFDS data_dir holding fashion_mnist prepared from Debian's files: ``$IPF_JAX_FASHION_MNIST_DIR``
  (``.ci/run``) or, without it, prepared here once per session (30 s)."""
  from ipf_jax.data import prepare

  source = prepare.DEBIAN_SOURCE["fashion_mnist"]
  given = os.environ.get(FASHION_MNIST_DIR_ENV)
  if given:
    assert prepare.prepared("fashion_mnist", given), f"{FASHION_MNIST_DIR_ENV}={given} holds no fashion_mnist"
    return given
  if not os.path.isdir(source):
    pytest.fail(
      f"{source} is missing: the Fashion-MNIST tests read the real files; run "
      "`apt-get update && apt-get install -y dataset-fashion-mnist` (what .ci/run does)"
    )
  where = str(tmp_path_factory.mktemp("tfds"))
  prepare.prepare_fashion_mnist(where, source)
  return where

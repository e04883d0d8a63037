"""All tests run on 8 fake CPU devices, compiled at LLVM optimisation level 0 (below).

Compiled programs are shared through JAX's persistent compilation cache (one
fresh directory per test session, inherited by the train.py subprocesses): many
tests compile the same digits step, and a cache hit replaces a compile.
"""
import os
import sys
import tempfile

os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="ipf_jax_tests_cache-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# The tests compile far more than they run: XLA's CPU backend at LLVM optimisation level 0 compiles the
# same programs in about half the time (tests/test_step.py's reference cases: 130 s -> 56 s). Results
# differ from level 2 at most by float rounding, which every comparison with a reference tolerates;
# bit-for-bit comparisons (resumed vs uninterrupted) run both sides under this same flag.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

"""Compressed consensus: int8 blocks, all_to_all + all_gather, error feedback without drift."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ipf_jax.population import compression
from ipf_jax.spmd import mesh as mesh_lib
from tests import helpers
from tests.test_step import run_both

pytestmark = pytest.mark.slow  # CI: leg 1 only (pytest.ini)


def test_quantize_roundtrip_error_is_within_half_a_step():
  x = np.random.default_rng(0).normal(size=(3, 4 * compression.BLOCK)).astype(np.float32) * 5
  q, s = compression.quantize(jnp.asarray(x))
  assert q.dtype == jnp.int8 and q.shape == (3, 4, compression.BLOCK) and s.shape == (3, 4)
  err = np.abs(np.asarray(compression.dequantize(q, s)) - x).reshape(3, 4, -1)
  assert np.all(err <= np.asarray(s)[..., None] / 2 + 1e-6)
  zero_q, zero_s = compression.quantize(jnp.zeros((compression.BLOCK,)))
  assert np.all(np.asarray(compression.dequantize(zero_q, zero_s)) == 0)


def consensus_fn(mesh, dp):
  tree_spec = {"a": P("particle"), "b": P("particle")}
  fn = jax.shard_map(
    lambda g, w, r: compression.compressed_consensus(g, w, r, "particle", dp),
    mesh=mesh,
    in_specs=(tree_spec, P("particle"), P("particle")),
    out_specs=({"a": P(), "b": P()}, P("particle")),
    check_vma=False,
  )
  return jax.jit(fn)


@pytest.mark.parametrize("dp,dd,per_device", [(8, 1, 1), (4, 2, 2), (2, 4, 4)])
def test_error_feedback_tracks_the_exact_running_sum(dp, dd, per_device):
  p = dp * per_device
  mesh = mesh_lib.make_mesh(p, jax.devices()[: dp * dd], dp)
  rng = np.random.default_rng(dp)
  shapes = {"a": (p, 37, 5), "b": (p, 300)}
  n = 37 * 5 + 300
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P("particle")))
  fn = consensus_fn(mesh, dp)
  residual = put(np.zeros((p, compression.residual_size(n)), np.float32))
  exact_sum = {k: 0.0 for k in shapes}
  comp_sum = {k: 0.0 for k in shapes}
  no_feedback_sum = {k: 0.0 for k in shapes}
  errors, drift = [], []
  for step in range(60):
    g = {k: rng.normal(size=s).astype(np.float32) * (1 + (k == "b")) for k, s in shapes.items()}
    w = rng.dirichlet(np.ones(p)).astype(np.float32)
    exact = {k: np.einsum("p,p...->...", w.astype(np.float64), v) for k, v in g.items()}
    out, residual = fn({k: put(v) for k, v in g.items()}, put(w), residual)
    plain, _ = fn({k: put(v) for k, v in g.items()}, put(w), put(np.zeros_like(np.asarray(residual))))
    for k in shapes:
      exact_sum[k] = exact_sum[k] + exact[k]
      comp_sum[k] = comp_sum[k] + np.asarray(out[k])
      no_feedback_sum[k] = no_feedback_sum[k] + np.asarray(plain[k])
      if step == 0:  # one exchange is close to exact: two roundings of at most half a step each
        np.testing.assert_allclose(out[k], exact[k], atol=0.05)
    errors.append(max(np.abs(comp_sum[k] - exact_sum[k]).max() for k in shapes))
    drift.append(max(np.abs(no_feedback_sum[k] - exact_sum[k]).max() for k in shapes))
  assert max(errors) < 0.1, "the running sum stays within one step's rounding of the exact one"
  assert np.mean(errors[-10:]) < 2 * np.mean(errors[5:15]) + 1e-3, "no drift with error feedback"
  assert drift[-1] > 2 * errors[-1], "without feedback the rounding errors accumulate"


def test_compressed_ipf_step_follows_the_exact_reference():
  """Training with compression stays close to the uncompressed reference (no resampling, loose tolerance)."""
  config = helpers.tiny_config(
    num_particles=8, temperature=1.0, correction=0.7, ess_threshold=0.0, compress_correction=True
  )
  s, ref, spmd, refr = run_both(config, 4, 2, num_steps=4)
  assert s.spec.compress_correction and s.host_state().residual.shape[0] == 8
  final = s.host_state()
  params, _, _ = ref.stacked()
  helpers.assert_close(final.params, params, rtol=2e-2, atol=2e-3)
  assert np.abs(final.residual).max() > 0, "rounding errors are carried to the next step"


def test_compressed_resampling_moves_residuals():
  config = helpers.tiny_config(
    num_particles=8, temperature=1.0, correction=0.5, ess_threshold=0.0, resample_every=1, compress_correction=True
  )
  s = helpers.Setup(config, 4, 2)
  images, labels = helpers.particle_batches(8, 1)[0]
  s.state, m = s.train_step(s.state, s.put(images, labels))
  before = s.host_state()
  s.state, m = s.train_step(s.state, s.put(images, labels))
  assert bool(m["resampled"])
  assert np.all(np.isfinite(s.host_state().residual))
  assert before.residual.shape == s.host_state().residual.shape

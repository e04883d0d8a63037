"""The eval step (every particle, both ensembles, the fused model) against numpy, on several meshes."""

import itertools

import jax
import numpy as np
import pytest

from tests import helpers

pytestmark = pytest.mark.slow  # CI: leg 1 only (pytest.ini)


def numpy_metrics(probs, labels, bins=15):
  conf, pred = probs.max(-1), probs.argmax(-1)
  brier = np.mean(np.sum((probs - np.eye(probs.shape[-1])[labels]) ** 2, -1))
  correct = (pred == labels).astype(float)
  nll = -np.log(np.maximum(probs[np.arange(len(labels)), labels], 1e-12))
  ece = 0.0
  which = np.minimum((conf * bins).astype(int), bins - 1)
  for b in range(bins):
    sel = which == b
    if sel.any():
      ece += sel.sum() / len(labels) * abs(correct[sel].mean() - conf[sel].mean())
  return {"accuracy": correct.mean(), "nll": nll.mean(), "ece": ece, "brier": brier}


@pytest.mark.parametrize("dp,dd,p,loop", [(8, 1, 8, "vmap"), (4, 2, 8, "vmap"), (1, 8, 2, "vmap"), (2, 4, 4, "map")])
def test_eval_matches_numpy(dp, dd, p, loop):
  config = helpers.tiny_config(num_particles=p, init="shared", eval_batch_size=64, particle_loop=loop)
  s = helpers.Setup(config, dp, dd)
  for images, labels in helpers.particle_batches(p, 3):  # a few steps so that particles differ
    s.state, _ = s.train_step(s.state, s.put(images, labels))
  host = s.host_state()
  rng = np.random.default_rng(p)
  log_w = np.log(rng.dirichlet(np.ones(p))).astype(np.float32)
  if p > 2:  # a culled particle with NaN parameters must not reach any metric
    log_w[1] = -np.inf
    for leaf in jax.tree.leaves(host.params):
      leaf[1] = np.nan
  log_w = log_w - np.logaddexp.reduce(log_w[np.isfinite(log_w)])
  host = host.replace(log_weights=log_w)
  state = jax.device_put(host, jax.tree.map(lambda x: x.sharding, s.state))

  data = helpers.digits_data()
  results = s.evaluate(state, data)

  x, y = data.test["image"], data.test["label"]
  apply = jax.jit(lambda v: jax.nn.softmax(s.plain_model.apply(v, x, train=False)))
  variables = lambda i: {
    "params": jax.tree.map(lambda a: a[i], host.params),
    "batch_stats": jax.tree.map(lambda a: a[i], host.batch_stats),
  }
  w = np.exp(log_w.astype(np.float64))
  alive = [i for i in range(p) if w[i] > 0]
  probs = {i: np.asarray(apply(variables(i)), np.float64) for i in range(p)}
  fused = jax.tree.map(
    lambda a: np.sum([w[i] * a[i] for i in alive], axis=0).astype(np.float32),
    {"params": host.params, "batch_stats": host.batch_stats},
  )
  expected = {
    "ensemble": numpy_metrics(sum(w[i] * probs[i] for i in alive), y),
    "ensemble_uniform": numpy_metrics(sum(probs[i] for i in alive) / len(alive), y),
    "fused": numpy_metrics(np.asarray(apply(fused), np.float64), y),
  }
  for key, exp in expected.items():
    for metric, value in exp.items():
      np.testing.assert_allclose(results[key][metric], value, rtol=1e-4, atol=1e-5, err_msg=f"{key} {metric}")
  for i in alive:
    for metric, value in numpy_metrics(probs[i], y).items():
      np.testing.assert_allclose(results["particles"][metric][i], value, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(results["weights"], w, rtol=1e-5, atol=1e-7)
  # the population's diversity (sums over "particle" and data shards): live particles only, pairwise loops
  pairs = list(itertools.permutations(alive, 2))
  disagree = np.mean([np.mean(probs[i].argmax(-1) != probs[j].argmax(-1)) for i, j in pairs])
  kl = np.mean([np.mean(np.sum(probs[i] * (np.log(probs[i]) - np.log(probs[j])), -1)) for i, j in pairs])
  np.testing.assert_allclose(results["diversity"]["disagreement"], disagree, rtol=1e-4, atol=1e-7)
  np.testing.assert_allclose(results["diversity"]["pairwise_kl"], kl, rtol=2e-3, atol=1e-5)


def _conv3x3_same(x, kernel):
  """numpy 'SAME' 3x3 convolution, stride 1, no bias: x [N, H, W, C], kernel [3, 3, C, F]."""
  n, h, w, _ = x.shape
  padded = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
  out = np.zeros((n, h, w, kernel.shape[-1]))
  for di in range(3):
    for dj in range(3):
      out += padded[:, di : di + h, dj : dj + w, :] @ kernel[di, dj]
  return out


@pytest.mark.parametrize("dp,dd,p,loop", [(8, 1, 8, "vmap"), (4, 2, 8, "vmap"), (1, 8, 2, "map"), (2, 4, 4, "unroll")])
def test_fused_bn_statistics_match_plain_computation(dp, dd, p, loop):
  """Re-estimated BatchNorm statistics of the fused model = per-shard batch statistics of the fused
  network (first layer: numpy convolution; all layers: the plain model, one shard at a time),
  averaged over the particles' shards; the eval step then uses them for the ``fused_bn`` row."""
  config = helpers.tiny_config(num_particles=p, init="shared", eval_batch_size=64, particle_loop=loop)
  s = helpers.Setup(config, dp, dd)
  batches = helpers.particle_batches(p, 4)
  for images, labels in batches[:3]:
    s.state, _ = s.train_step(s.state, s.put(images, labels))
  host = s.host_state()
  images, labels = batches[3]
  got = jax.device_get(s.parts.fused_bn_fn(s.state, s.put(images, labels)))

  w = np.exp(host.log_weights.astype(np.float64))
  fused = jax.tree.map(lambda a: np.tensordot(w, a, axes=1).astype(np.float32), host.params)
  # First BatchNorm by hand: mean and (biased) variance of the first convolution's output per shard.
  first = [_conv3x3_same(images[i].astype(np.float64), fused["Conv_0"]["kernel"]) for i in range(p)]
  np.testing.assert_allclose(
    got["BatchNorm_0"]["mean"], np.mean([f.mean(axis=(0, 1, 2)) for f in first], axis=0), rtol=1e-4, atol=1e-5
  )
  np.testing.assert_allclose(
    got["BatchNorm_0"]["var"], np.mean([f.var(axis=(0, 1, 2)) for f in first], axis=0), rtol=1e-4, atol=1e-5
  )
  # Every layer: the plain model on one shard at a time (its running statistics with momentum 0).
  plain = s.plain_model.clone(bn_momentum=0.0)
  zeros = jax.tree.map(lambda a: np.zeros_like(a[0]), host.batch_stats)
  shards = [
    plain.apply({"params": fused, "batch_stats": zeros}, images[i], train=True, mutable=["batch_stats"])[1]
    for i in range(p)
  ]
  helpers.assert_close(got, jax.tree.map(lambda *xs: np.mean(xs, axis=0), *[sh["batch_stats"] for sh in shards]))

  data = helpers.digits_data()
  results = s.evaluate(s.state, data, fused_bn=got)
  probs = jax.nn.softmax(s.plain_model.apply({"params": fused, "batch_stats": got}, data.test["image"], train=False))
  for metric, value in numpy_metrics(np.asarray(probs, np.float64), data.test["label"]).items():
    np.testing.assert_allclose(results["fused_bn"][metric], value, rtol=1e-4, atol=1e-5, err_msg=metric)
  assert "fused_bn" not in s.evaluate(s.state, data)


def test_processes_with_parts_of_different_lengths_agree_on_the_batches(monkeypatch):
  """Each process reads its own part of the eval set: one with fewer batches goes on with all-masked ones
  until every part has ended; a process with an empty part while others have batches is one DataError
  on every process (not a hang in a collective). The other process is simulated: its (has a batch,
  can pad) flags are appended to this one's."""
  from jax.experimental import multihost_utils

  from ipf_jax.data.errors import DataError
  from ipf_jax.spmd import eval_step

  def with_peer(peer_batches):
    left = [peer_batches]

    def gather(flags):
      has = int(left[0] > 0)
      left[0] -= has
      return np.stack([np.asarray(flags), np.array([has, has or peer_batches > 0], np.int32)])

    return gather

  mine = [{"x": np.arange(4.0), "mask": np.ones(4, np.float32)}]
  monkeypatch.setattr(multihost_utils, "process_allgather", with_peer(3))
  out = list(eval_step._agreed(iter(mine), across_processes=True))
  assert len(out) == 3 and out[0] is mine[0]
  for b in out[1:]:
    assert not b["mask"].any() and b["x"].shape == (4,)  # padding: same shapes, nothing counted
  monkeypatch.setattr(multihost_utils, "process_allgather", with_peer(1))
  assert len(list(eval_step._agreed(iter(mine * 2), across_processes=True))) == 2  # mine are longer
  monkeypatch.setattr(multihost_utils, "process_allgather", with_peer(2))
  with pytest.raises(DataError, match=r"processes \[0\] are empty"):
    list(eval_step._agreed(iter([]), across_processes=True))

"""The library API: any Flax module, any per-example loss, labels of any shape, dropout, regression."""

import functools
import os
import signal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ipf_jax
from ipf_jax.runtime import preemption
from tests import helpers

pytestmark = pytest.mark.core  # CI: every leg (pytest.ini)


class GaussianHead(nn.Module):
  """No BatchNorm; outputs (mean, raw scale)."""

  @nn.compact
  def __call__(self, x, train: bool):
    return nn.Dense(2)(nn.tanh(nn.Dense(16)(x)))


def regression_data(n=96, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 3)).astype(np.float32)
  y = (x @ np.array([1.0, -2.0, 0.5]) + 0.3 * rng.normal(size=n)).astype(np.float32)
  return {"x": x, "y": y}


@pytest.mark.parametrize("dp,dd,p", helpers.mark_slow([(4, 2, 4), (2, 4, 4), (8, 1, 8)], "8-1-8", "2-4-4"))
def test_regression_ensembles_are_gaussian_mixtures(dp, dd, p):
  """Every row of the eval table against numpy: per particle, the weighted and uniform mixtures of the
  particles' Gaussians (NLL from the mixture density, RMSE of the mixture mean) and the fused model."""
  config = helpers.tiny_config(num_particles=p, init="independent", eval_batch_size=40, temperature=1.0, base_lr=0.05)
  task = ipf_jax.gaussian_regression(GaussianHead())
  train, test = regression_data(p * helpers.PER_PARTICLE_BATCH * 3), regression_data(70, seed=1)
  s = helpers.Setup(config, dp, dd, task=task, example={k: v[:1] for k, v in train.items()})
  from ipf_jax.spmd import layout

  for k in range(3):
    shard = slice(k * p * helpers.PER_PARTICLE_BATCH, (k + 1) * p * helpers.PER_PARTICLE_BATCH)
    s.state, _ = s.train_step(s.state, layout.put_train_batch({f: v[shard] for f, v in train.items()}, p, s.mesh))
  data = ipf_jax.ArrayDataset("synthetic", train=train, test=test)
  results = s.evaluate(s.state, data)

  host = s.host_state()
  w = np.exp(host.log_weights.astype(np.float64))
  apply = lambda params: np.asarray(GaussianHead().apply({"params": params}, test["x"], train=False), np.float64)
  outs = [apply(jax.tree.map(lambda a: a[i], host.params)) for i in range(p)]
  mean = [o[:, 0] for o in outs]
  sigma = [np.log1p(np.exp(o[:, 1])) + 1e-3 for o in outs]
  y = test["y"].astype(np.float64)
  log_density = lambda m, sg: -0.5 * np.log(2 * np.pi) - np.log(sg) - 0.5 * ((y - m) / sg) ** 2
  logd = [log_density(m, sg) for m, sg in zip(mean, sigma)]
  mix = lambda ws: np.logaddexp.reduce([np.log(wi) + ld for wi, ld in zip(ws, logd)], axis=0)
  row = lambda ld, m: {"nll": -np.mean(ld), "rmse": np.sqrt(np.mean((y - m) ** 2))}
  fused = jax.tree.map(lambda a: np.tensordot(w, a, axes=1).astype(np.float32), host.params)
  fo = apply(fused)
  expected = {
    "ensemble": row(mix(w), sum(wi * m for wi, m in zip(w, mean))),
    "ensemble_uniform": row(mix(np.full(p, 1.0 / p)), sum(mean) / p),
    "fused": row(log_density(fo[:, 0], np.log1p(np.exp(fo[:, 1])) + 1e-3), fo[:, 0]),
  }
  for key, exp in expected.items():
    for metric, value in exp.items():
      np.testing.assert_allclose(results[key][metric], value, rtol=2e-4, err_msg=f"{key} {metric}")
  for i in range(p):
    np.testing.assert_allclose(results["particles"]["nll"][i], row(logd[i], mean[i])["nll"], rtol=2e-4)
    np.testing.assert_allclose(results["particles"]["rmse"][i], row(logd[i], mean[i])["rmse"], rtol=2e-4)


class MultiLabel(nn.Module):
  """Dropout, no BatchNorm; 4 independent binary labels per example (labels of shape [4])."""

  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Dropout(0.3, deterministic=not train)(nn.relu(nn.Dense(32)(x.reshape(x.shape[0], -1))))
    return nn.Dense(4)(x)


def multilabel_task():
  def loss(logits, batch):  # per-example binary cross-entropy over the 4 labels
    return jnp.mean(jnp.logaddexp(0.0, logits) - batch["tags"] * logits, axis=-1)

  def score(probs, batch, mask):
    correct = ((probs > 0.5) == (batch["tags"] > 0.5)).all(-1).astype(jnp.float32)
    return {"count": mask.sum(), "correct": (correct * mask).sum()}

  return ipf_jax.Task(
    model=MultiLabel(),
    loss=loss,
    predictive=lambda logits, batch: jax.nn.sigmoid(logits),
    score=score,
    finalize=lambda s: {"exact_match": s["correct"] / s["count"]},
    columns=(("exact match", "exact_match", "{:.2%}"),),
    inputs="image",
    rngs=("dropout",),
  )


def multilabel_data():
  d = helpers.digits_data()
  tags = lambda y: np.stack([y % 2 == 0, y < 5, y % 3 == 0, y == 7], axis=1).astype(np.float32)
  return ipf_jax.ArrayDataset(
    "digits tags",
    train={"image": d.train["image"], "tags": tags(d.train["label"])},
    test={"image": d.test["image"], "tags": tags(d.test["label"])},
  )


def library_config(**kw):
  config = ipf_jax.default_config()
  config.num_particles, config.global_batch_size, config.num_train_steps = 4, 64, 24
  config.log_every_steps, config.checkpoint_every_steps, config.base_lr = 1, 100, 1.0
  for k, v in kw.items():
    config[k] = v
  return config


def test_any_module_loss_and_label_shape_with_dropout_resumes_identically(tmp_path):
  """A custom multi-label task with dropout, stopped by SIGTERM at step 9 and resumed, ends exactly
  where the uninterrupted run ends: each particle's dropout key comes from (rng, step, slot, shard)."""
  data = multilabel_data()
  full = ipf_jax.train_and_evaluate(library_config(), str(tmp_path / "full"), task=multilabel_task(), data=data)
  assert full["ensemble"]["exact_match"] > 0.25, full["ensemble"]  # a constant guess gets about 0.13

  def stop_at_9(step, state, batch):
    if step == 9:
      os.kill(os.getpid(), signal.SIGTERM)  # handled after this step: saved at 10
    return state, batch

  with pytest.raises(preemption.RunStopped, match="stopped at step 10 by SIGTERM"):
    ipf_jax.train_and_evaluate(
      library_config(), str(tmp_path / "cut"), task=multilabel_task(), data=data, step_hook=stop_at_9
    )
  resumed = ipf_jax.train_and_evaluate(library_config(), str(tmp_path / "cut"), task=multilabel_task(), data=data)
  for row in ("ensemble", "fused", "particles"):
    np.testing.assert_array_equal(resumed[row]["exact_match"], full[row]["exact_match"])
  np.testing.assert_array_equal(resumed["weights"], full["weights"])
  a, b = (helpers.load_checkpoint_numpy(tmp_path / d / "checkpoints" / "24" / "state") for d in ("full", "cut"))
  jax.tree.map(np.testing.assert_array_equal, a, b)


def test_dropout_keys_differ_between_particles_shards_and_steps():
  from jax.sharding import PartitionSpec as P

  from ipf_jax.spmd.particles import particle_keys

  mesh = jax.make_mesh((4, 2), ("particle", "data"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  keys_at = jax.jit(
    jax.shard_map(lambda k: particle_keys(k, 2)[None], mesh=mesh, in_specs=P(), out_specs=P(("particle", "data")))
  )
  rows = set()
  for step in (0, 1):  # the step's key: fold_in(rng, step), as in the train step
    keys = np.asarray(keys_at(jax.random.fold_in(jax.random.PRNGKey(3), step)))
    rows |= {k.tobytes() for k in keys.reshape(-1, keys.shape[-1])}
  assert len(rows) == 32, "2 steps x 4 particle groups x 2 local particles x 2 data shards: all distinct"


@pytest.mark.slow
def test_data_from_your_own_functions(tmp_path):
  """``ipf_jax.Data``: train batches from a function of the start step, eval batches of any size."""
  d = helpers.digits_data()
  source = ipf_jax.ArrayDataset("digits", train=d.train, test=d.test, num_classes=10)
  data = ipf_jax.Data(
    train=lambda start: source.train_batches(start, 64, seed=0),
    eval=lambda: (
      dict(image=d.test["image"][i : i + 100], label=d.test["label"][i : i + 100])
      for i in range(0, source.test_size, 100)
    ),
    example=source.example,
    name="digits",
    test_size=source.test_size,
  )
  from ipf_jax.config import builder

  task = builder.zoo_task(library_config(), 10)
  results = ipf_jax.train_and_evaluate(library_config(num_train_steps=12), str(tmp_path), task=task, data=data)
  reference = ipf_jax.evaluate_checkpoint(
    library_config(num_train_steps=12), str(tmp_path), task=task, data=source
  )  # same checkpoint, eval batches from the arrays
  for row in ("ensemble", "fused"):
    assert results[row]["accuracy"] == pytest.approx(reference[row]["accuracy"], abs=1e-9)


def test_your_data_ending_early_or_without_epochs_is_one_clear_error(tmp_path):
  from ipf_jax.config import validation
  from ipf_jax.data.errors import DataError

  d = helpers.digits_data()
  source = ipf_jax.ArrayDataset("digits", train=d.train, test=d.test, num_classes=10)
  short = ipf_jax.Data(
    train=lambda start: iter([source.train_batch(k, 64, 0) for k in range(start, 3)]),
    num_classes=10,
    eval=lambda: source.eval_batches(100),
    example=source.example,
    name="three batches",
  )
  with pytest.raises(DataError, match="the training data 'three batches' ended at step 3"):
    ipf_jax.train_and_evaluate(library_config(num_train_steps=6), str(tmp_path / "a"), data=short)
  with pytest.raises(validation.ConfigError, match="num_epochs: the data 'three batches' does not know its epoch"):
    ipf_jax.train_and_evaluate(library_config(num_epochs=2.0), str(tmp_path / "b"), data=short)
  with pytest.raises(TypeError, match="train and eval are functions"):
    ipf_jax.Data(train=[source.example], eval=lambda: [], example=source.example)


def test_resuming_on_other_data_is_refused():
  from ipf_jax.runtime import checkpoint, compatibility

  sig, config = {"params/w": ((2,), "float32")}, ipf_jax.default_config()
  with pytest.raises(checkpoint.CheckpointError, match="was trained on 'digits', this run reads 'my data'"):
    compatibility.check_compatible(sig, {}, sig, config, "ckpt", saved_data="digits", data="my data")
  compatibility.check_compatible(sig, {}, sig, config, "ckpt", saved_data="digits", data="digits")


@pytest.mark.slow
def test_another_optimizer_is_named_on_resume(tmp_path, capsys):
  """A workdir trained with the built-in SGD, resumed with AdamW from library code: refused, naming both
  optimizers (not "another version of ipf_jax"); one of the same state kind resumes, with a warning."""
  import optax

  from ipf_jax.runtime import checkpoint, trainer
  from ipf_jax.config import read

  d = helpers.digits_data()
  data = ipf_jax.ArrayDataset("digits", train=d.train, test=d.test, num_classes=10)
  ipf_jax.train_and_evaluate(library_config(num_train_steps=3), str(tmp_path), data=data)
  with pytest.raises(checkpoint.CheckpointError) as refused:
    ipf_jax.train_and_evaluate(
      library_config(num_train_steps=6),
      str(tmp_path),
      data=data,
      optimizer=lambda lr: optax.adamw(lr, weight_decay=0.05),
    )
  message = str(refused.value)
  assert "written by the optimizer sgd(momentum=0.9, nesterov=True" in message, message
  assert "this run's is a custom optimizer (state: ScaleByAdamState" in message, message
  assert "another version" not in message and "Nothing was changed" in message
  with pytest.raises(checkpoint.CheckpointError, match=r"the optimizer sgd.*this run's is adamw \(state"):
    trainer.check_run(
      library_config(num_train_steps=6),
      str(tmp_path),
      data=data,
      optimizer=functools.partial(optax.adamw, weight_decay=0.05),
    )

  def my_sgd(lr):  # the built-in optimizer under another name: the state fits
    return read.optimizer(library_config(), lr)

  capsys.readouterr()
  results = ipf_jax.train_and_evaluate(library_config(num_train_steps=6), str(tmp_path), data=data, optimizer=my_sgd)
  out = capsys.readouterr().out
  assert "resumed from" in out and "this run's optimizer differs from the checkpoint's: sgd(momentum=0.9" in out, out
  assert "there, my_sgd (MaskedState, TraceState, ScaleByScheduleState) here" in out, out
  assert "final evaluation at step 6" in out and results["ensemble"]["accuracy"] > 0.2, out[-2000:]


def test_an_old_checkpoint_whose_optimizer_state_differs_says_so():
  from ipf_jax.runtime import checkpoint, compatibility

  saved = {"params/w": ((2,), "float32"), "opt_state/0/trace/w": ((2,), "float32")}
  now = {"params/w": ((2,), "float32"), "opt_state/0/mu/w": ((2,), "float32"), "opt_state/0/nu/w": ((2,), "float32")}
  here = {"name": "adamw", "state": "ScaleByAdamState, ScaleByScheduleState", "builtin": False}
  with pytest.raises(
    checkpoint.CheckpointError,
    match=r"predates the record of its optimizer, so the config's SGD "
    r"\(momentum 0.9\) wrote it, and this run's optimizer is "
    r"adamw \(state: ScaleByAdamState",
  ):
    compatibility.check_compatible(saved, {"momentum": 0.9}, now, ipf_jax.default_config(), "ckpt", optimizer=here)
  builtin = dict(here, name="sgd(...)", builtin=True)  # the same optimizer as then: the cause is elsewhere
  with pytest.raises(checkpoint.CheckpointError, match="probably written by another version of ipf_jax"):
    compatibility.check_compatible(saved, {}, now, ipf_jax.default_config(), "ckpt", optimizer=builtin)

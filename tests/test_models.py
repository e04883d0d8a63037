"""The model zoo's Vision Transformers: parameter counts against the published one and a formula, and a ViT
trained as a population through the library with AdamW, dropout and stochastic depth."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ipf_jax.errors import ConfigError

from ipf_jax.models import vit

pytestmark = pytest.mark.core  # CI: every leg (pytest.ini)


def count(model, image: int, channels: int = 3) -> int:
  shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, image, image, channels))))
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))


def by_formula(width, depth, mlp, patch, image, classes, channels=3, pool="tok", posemb="learn") -> int:
  """Patch embedding, class token and learned position embedding, per block two LayerNorms, q/k/v/out
  projections with biases and the two MLP layers, the final LayerNorm, the head."""
  tokens = (image // patch) ** 2 + (pool == "tok")
  block = 2 * 2 * width + 4 * (width * width + width) + (width * mlp + mlp) + (mlp * width + width)
  return (
    patch * patch * channels * width
    + width
    + (width if pool == "tok" else 0)
    + (tokens * width if posemb == "learn" else 0)
    + depth * block
    + 2 * width
    + width * classes
    + classes
  )


def test_vit_b16_has_the_published_parameter_count():
  assert count(vit.create("vit_b16", 1000), 224) == 86_567_656  # ViT-B/16, ImageNet-1k head


@pytest.mark.parametrize("name", sorted(vit.VARIANTS))
@pytest.mark.parametrize("pool,posemb", [("tok", "learn"), ("gap", "sincos2d")])
def test_every_vit_matches_the_formula(name, pool, posemb):
  size, patch = vit.VARIANTS[name]
  width, depth, mlp, _ = vit.SIZES[size]
  got = count(vit.create(name, 1000, pool=pool, posemb=posemb), 224)
  assert got == by_formula(width, depth, mlp, patch, 224, 1000, pool=pool, posemb=posemb)


def test_sincos_position_embedding_by_hand():
  """Row ``y * w + x``: sin/cos of ``x * omega`` then of ``y * omega``, omega = 10000^(-i / (d/4 - 1))."""
  pe = np.asarray(vit.posemb_sincos_2d(3, 2, 8))[0]
  omega = 1.0 / 10_000.0 ** (np.arange(2) / 1)
  for y in range(3):
    for x in range(2):
      want = np.concatenate([np.sin(x * omega), np.cos(x * omega), np.sin(y * omega), np.cos(y * omega)])
      np.testing.assert_allclose(pe[y * 2 + x], want, rtol=1e-6)


@pytest.mark.slow
def test_a_vit_population_trains_with_adamw_dropout_and_stochastic_depth(tmp_path):
  """A two-block ViT (patches of 4 on the 8 x 8 digits: 4 tokens and the class token) as the task, 4 particles
  on a (2, 2) mesh, ``config.optimizer=adamw`` with its first moment in bfloat16: the population trains,
  resamples, draws dropout, and its fused model loads back (``vit_ti16`` itself compiles for minutes here: the
  zoo name is checked by ``--dry_run`` below)."""
  import ipf_jax
  from configs import digits
  from ipf_jax import models
  from ipf_jax.config import read
  from ipf_jax.runtime import trainer

  config = digits.get_config()
  config.update(
    optimizer="adamw",
    mu_dtype="bfloat16",
    base_lr=1e-3,
    weight_decay=0.05,
    num_particles=4,
    particle_axis_size=2,
    num_cpu_devices=0,
    num_devices=4,
    global_batch_size=32,
    num_train_steps=6,
    warmup_steps=2,
    log_every_steps=3,
    checkpoint_every_steps=0,
    eval_batch_size=64,
    ess_threshold=1.0,
  )
  small = vit.ViT(
    num_classes=10, patch_size=4, width=32, depth=2, mlp_dim=64, num_heads=2, dropout=0.1, stochastic_depth=0.1
  )
  task = ipf_jax.classification(small, rngs=("dropout",))
  results = ipf_jax.train_and_evaluate(config, str(tmp_path / "run"), task=task)
  assert len(results["particles"]["accuracy"]) == 4 and np.isfinite(results["ensemble"]["nll"])
  model, variables = ipf_jax.load_fused(str(tmp_path / "run" / "fused_model"), model=small)
  logits = model.apply(variables, jnp.zeros((2, 8, 8, 1)), train=False)
  assert logits.shape == (2, 10) and np.isfinite(np.asarray(logits)).all()

  config.update(model="vit_ti16", vit_patch_size=4, dropout=0.1, stochastic_depth=0.1)
  plan = trainer.check_run(config, str(tmp_path / "zoo"))
  assert "would train 6 steps" in plan, plan
  assert read.model_spec(config, 10).rngs == ("dropout",)
  config.vit_patch_size = 0  # 16 x 16 patches on 8 x 8 digits: refused, naming the sizes that tile them
  with pytest.raises(
    ConfigError,
    match=r"config.model: vit_ti16's 16 x 16 patches do not tile the 8 x 8 images; "
    r"set vit_patch_size to one of \[2, 4, 8\]",
  ):
    trainer.check_run(config, str(tmp_path / "zoo"))
  config.vit_patch_size = 4
  zoo = models.model_from_fields(read.model_spec(config, 10).fields())
  assert isinstance(zoo, vit.ViT) and (zoo.patch_size, zoo.width, zoo.depth, zoo.dropout) == (4, 192, 12, 0.1)
  assert not zoo.scan
  config.vit_scan = True  # an export records it, so the fused model rebuilds with its blocks stacked
  fields = read.model_spec(config, 10).fields()
  assert fields["vit_scan"] is True and models.model_from_fields(fields).scan
  del fields["vit_scan"]  # an export written before the field existed: unrolled, as it was trained
  assert not models.model_from_fields(fields).scan


SMALL = dict(num_classes=5, patch_size=4, width=16, mlp_dim=32, num_heads=2)


@pytest.mark.parametrize("remat", [False, True])
def test_the_scanned_vit_is_the_unrolled_one_with_its_blocks_stacked(remat):
  """``scan=True`` (``nn.scan`` over the blocks) computes what the unrolled ViT computes: from the unrolled
  model's parameters stacked by hand (``np.stack`` of ``encoderblock_{i}``), the same logits and, unstacked, the
  same gradient; ``stack_blocks`` / ``unstack_blocks`` are that stacking and its inverse, and the scanned
  model's own init has the stacked tree's shapes."""
  x = jnp.asarray(np.random.RandomState(0).randn(4, 8, 8, 3), jnp.float32)
  unrolled, scanned = vit.ViT(**SMALL, depth=3, remat=remat), vit.ViT(**SMALL, depth=3, remat=remat, scan=True)
  params = unrolled.init(jax.random.key(0), x)["params"]
  blocks = [params["Transformer"][f"encoderblock_{i}"] for i in range(3)]
  by_hand = {**params, "Transformer": {"encoder_norm": params["Transformer"]["encoder_norm"]}}
  by_hand["Transformer"]["encoderblock"] = jax.tree.map(lambda *xs: np.stack(xs), *blocks)
  jax.tree.map(np.testing.assert_array_equal, vit.stack_blocks(params), by_hand)
  jax.tree.map(np.testing.assert_array_equal, jax.jit(vit.stack_blocks)(params), by_hand)  # traceable
  gap = {**params, "Transformer": {k: v for k, v in params["Transformer"].items() if k != "encoderblock_1"}}
  with pytest.raises(ValueError, match="left unstacked: Transformer/encoderblock_0/"):
    vit.stack_blocks(gap)
  jax.tree.map(np.testing.assert_array_equal, vit.unstack_blocks(by_hand), params)
  own = jax.eval_shape(lambda: scanned.init(jax.random.key(0), x)["params"])
  assert jax.tree.map(jnp.shape, own) == jax.tree.map(jnp.shape, by_hand)
  np.testing.assert_allclose(scanned.apply({"params": by_hand}, x), unrolled.apply({"params": params}, x), atol=1e-6)
  loss = lambda model: lambda p: jnp.sum(jnp.square(model.apply({"params": p}, x)))
  want = jax.grad(loss(unrolled))(params)
  got = vit.unstack_blocks(jax.grad(loss(scanned))(by_hand))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)


def test_a_scanned_block_drops_its_own_path_rate():
  """Stochastic depth in the scanned ViT: block ``i`` drops at ``stochastic_depth * i / (depth - 1)``, as the
  unrolled one does. Two blocks at 0.9999: the first never drops, the second (almost surely) always, so in
  training both models compute block 0 alone, which differs from evaluation (both blocks)."""
  x = jnp.asarray(np.random.RandomState(1).randn(4, 8, 8, 3), jnp.float32)
  unrolled = vit.ViT(**SMALL, depth=2, stochastic_depth=0.9999)
  scanned = vit.ViT(**SMALL, depth=2, stochastic_depth=0.9999, scan=True, remat=True)
  params = unrolled.init(jax.random.key(0), x)["params"]
  params["head"]["kernel"] = jax.random.normal(jax.random.key(2), params["head"]["kernel"].shape)  # not zeros
  stacked = vit.stack_blocks(params)
  rngs = {"dropout": jax.random.key(3)}
  trained = scanned.apply({"params": stacked}, x, train=True, rngs=rngs)
  np.testing.assert_allclose(trained, unrolled.apply({"params": params}, x, train=True, rngs=rngs), atol=1e-5)
  evaluated = scanned.apply({"params": stacked}, x)
  assert np.abs(np.asarray(trained - evaluated)).max() > 1e-3

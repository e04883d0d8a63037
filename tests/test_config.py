"""Configs that cannot work stop before compiling, naming the field and a fix."""

import pytest

from configs import default, digits
from ipf_jax.config import validation
from ipf_jax.errors import ConfigError

pytestmark = pytest.mark.slow  # CI: leg 1 only (pytest.ini)


def cfg(**kw):
  c = digits.get_config()
  for k, v in kw.items():
    c[k] = v
  return c


@pytest.mark.parametrize(
  "overrides,devices,field,hint",
  [
    (dict(num_particles=12, particle_axis_size=8), 8, "num_particles", "multiple of 8"),
    (dict(num_particles=8, global_batch_size=100), 8, "global_batch_size", "multiple of 8"),
    (dict(num_particles=4, global_batch_size=36), 8, "global_batch_size", "4 x 2"),
    (dict(mode="bayes"), 8, "mode", "ddp, ensemble, ipf"),
    (dict(temperature=-1.0), 8, "temperature", ">= 0"),
    (dict(correction=1.5), 8, "correction", "[0, 1]"),
    (dict(correction=-0.1), 8, "correction", "[0, 1]"),
    (dict(elastic_pull=1.5), 8, "elastic_pull", "[0, 1]"),
    (dict(num_devices=16), 8, "num_devices", "<= 8"),
    (dict(mode="ddp"), 8, "num_particles", "num_particles=1"),
    (dict(forgetting=1.5), 8, "forgetting", "[0, 1]"),
    (dict(weigh_on="shared"), 8, "weigh_on", "use one of own, common"),
    (dict(weigh_on="common", common_examples=17), 8, "common_examples", "use at most 16"),
    (dict(calibration_fraction=0.5), 8, "calibration_fraction", "[0, 0.5)"),
    (dict(islands=3), 8, "islands", "divides num_particles=8"),
    (dict(islands=0), 8, "islands", "integer >= 1"),
    (dict(ess_threshold=2.0), 8, "ess_threshold", "[0, 1]"),
    (dict(lr_scaling="cubic"), 8, "lr_scaling", "none, linear, sqrt"),
    (dict(init="random"), 8, "init", "auto, shared, independent"),
    (dict(particle_axis_size=3), 8, "particle_axis_size", "divisor of 8"),
    (dict(num_train_steps=0), 8, "num_train_steps", ">= 1"),
    (dict(eval_batch_size=0), 8, "eval_batch_size", "must be positive"),
    (dict(keep_checkpoints=0), 8, "keep_checkpoints", ">= 1"),
    (dict(checkpoint_every_steps=-2), 8, "checkpoint_every_steps", "-1 (never)"),
    (dict(log_every_steps=0), 8, "log_every_steps", ">= 1"),
    (dict(eval_every_steps=-1), 8, "eval_every_steps", ">= 0"),
    (dict(base_lr=0.0), 8, "base_lr", "> 0"),
    (dict(momentum=1.0), 8, "momentum", "[0, 1)"),
    (dict(weight_decay=-1e-4), 8, "weight_decay", ">= 0"),
    (dict(grad_clip_norm=-1.0), 8, "grad_clip_norm", ">= 0"),
    (dict(jitter=-0.1), 8, "jitter", ">= 0"),
    (dict(fused_bn_batches=-1), 8, "fused_bn_batches", "integer >= 0"),
    (dict(resample_every=-1), 8, "resample_every", ">= 0"),
    (dict(warmup_steps=-1), 8, "warmup_steps", ">= 0"),
    (dict(reference_batch_size=0), 8, "reference_batch_size", ">= 1"),
    (dict(bn_momentum=1.0), 8, "bn_momentum", "[0, 1)"),
    (dict(cnn_features=()), 8, "cnn_features", "non-empty"),
    (dict(num_epochs=-1.0), 8, "num_epochs", ">= 0"),
    (dict(warmup_epochs=-1.0), 8, "warmup_epochs", ">= 0"),
    (dict(label_smoothing=1.0), 8, "label_smoothing", "[0, 1)"),
    (dict(grad_accum_steps=0), 8, "grad_accum_steps", ">= 1"),
    # 128 / (8 particles x 1) = 16 examples per particle and data shard: 3 micro-batches do not divide them
    (
      dict(grad_accum_steps=3),
      8,
      "grad_accum_steps",
      "use a divisor of 16 such as 2, or a global_batch_size that is a multiple of 24",
    ),
    (dict(image_size=4), 8, "image_size", ">= 8"),
    (dict(shuffle_buffer=0), 8, "shuffle_buffer", ">= 1"),
    (dict(train_fraction=0.0), 8, "train_fraction", "(0, 1]"),
    (dict(label_noise=1.0), 8, "label_noise", "[0, 1)"),
    (dict(dataset="cifar10", label_noise=0.1), 8, "train_fraction", "digits dataset only"),
    (dict(temperature=float("inf")), 8, "temperature", "finite number"),
    (dict(forgetting=float("nan")), 8, "forgetting", "finite number"),
    (dict(correction=float("nan")), 8, "correction", "finite number"),
    (dict(elastic_pull=float("inf")), 8, "elastic_pull", "finite number"),
    (dict(base_lr=float("inf")), 8, "base_lr", "finite number"),
    (dict(train_fraction=float("nan")), 8, "train_fraction", "finite number"),
    (dict(seed=-1), 8, "seed", "[0, 2**32)"),
    (dict(seed=2**32), 8, "seed", "[0, 2**32)"),
    (dict(checkpoint_every_minutes=-1.0), 8, "checkpoint_every_minutes", ">= 0"),
    (dict(time_limit_minutes=-1.0), 8, "time_limit_minutes", ">= 0"),
    (dict(dtype="float64"), 8, "dtype", "float32, bfloat16, float16"),
    (dict(loss_scale_init=1000.0), 8, "loss_scale_init", "power of 2"),
    (dict(loss_scale_init=0.5), 8, "loss_scale_init", "power of 2 >= 1"),
    (dict(loss_scale_growth_interval=0), 8, "loss_scale_growth_interval", ">= 1"),
    (dict(particle_loop="scan"), 8, "particle_loop", "vmap, map, unroll"),
    (dict(resample_exchange="ragged"), 8, "resample_exchange", "use rounds or auto on the CPU"),
    (dict(resample_placement="nearest"), 8, "resample_placement", "ascending, local"),
    (dict(shared_params="(conv"), 8, "shared_params", "not a valid regular expression"),
    (dict(num_cpu_devices=-1), 8, "num_cpu_devices", ">= 0"),
    (dict(num_devices=-1), 8, "num_devices", ">= 0"),
    (dict(particle_axis_size=-1), 8, "particle_axis_size", ">= 0"),
    (dict(global_batch_size=0), 8, "global_batch_size", ">= 1"),
    (dict(num_particles=0), 8, "num_particles", ">= 1"),
  ],
)
def test_bad_config_names_field_and_fix(overrides, devices, field, hint):
  with pytest.raises(ConfigError) as e:
    validation.validate(cfg(**overrides), devices)
  assert e.value.field == field
  assert str(e.value).startswith(f"config.{field}:")
  assert hint in str(e.value)


@pytest.mark.parametrize(
  "field,value,hint", [("dataset", "mnist", "digits, imagenet2012"), ("model", "vgg16", "cnn, resnet18")]
)
def test_unknown_dataset_or_model_is_refused_where_it_is_built(field, value, hint):
  """The names are checked by the registries that build them (configuration imports neither)."""
  from ipf_jax.config import read

  config = cfg(**{field: value})
  with pytest.raises(ConfigError) as e:
    read.dataset(config) if field == "dataset" else read.model(config, 10)
  assert e.value.field == field and hint in str(e.value)


@pytest.mark.parametrize(
  "overrides,field,hint",
  [
    (
      dict(global_batch_size=2048),
      "global_batch_size",
      "larger than the digits training set (1347 examples); use at most 1347 (a multiple of 8, e.g. 1344)",
    ),
    (
      dict(train_fraction=0.01, global_batch_size=128),
      "train_fraction",
      "0.01 keeps 13 training examples, fewer than one global batch (global_batch_size=128)",
    ),
  ],
)
def test_one_global_batch_must_fit_in_the_training_set(overrides, field, hint):
  from ipf_jax.config import read

  config = cfg(**overrides)
  with pytest.raises(ConfigError) as e:
    validation.validate_data(config, read.dataset(config).train_size, 8)
  assert e.value.field == field and hint in str(e.value)


def test_every_shipped_config_is_valid_and_its_model_builds():
  """Every file of configs/ validates on 8 devices, and its zoo model initialises (shapes only): the ViT
  recipes' ViT-S/16 (gap, sin-cos: no class token, no learned position embedding) has 21,974,632 parameters
  at 1,000 classes, ViT-Ti at patch 4 on 28 x 28 5,353,738 at 10 (``tests/test_models.py``'s formula)."""
  import importlib
  import os

  import jax
  import jax.numpy as jnp

  from ipf_jax.config import read

  folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
  names = sorted(f[:-3] for f in os.listdir(folder) if f.endswith(".py") and f != "__init__.py")
  assert {"digits", "fashion_mnist_vit", "imagenet_vit_s16"} <= set(names)
  counts = {}
  for name in names:
    config = importlib.import_module(f"configs.{name}").get_config()
    validation.validate(config, 8)
    if config.model.startswith("vit"):
      classes, size = (1000, 224) if config.dataset == "imagenet2012" else (10, config.image_size)
      channels = 3 if config.dataset == "imagenet2012" else 1
      model = read.model(config, classes)
      shapes = jax.eval_shape(lambda m=model: m.init(jax.random.PRNGKey(0), jnp.zeros((1, size, size, channels))))
      counts[name] = sum(x.size for x in jax.tree.leaves(shapes))
  assert counts == {"fashion_mnist_vit": 5_353_738, "imagenet_vit_s16": 21_974_632}, counts


def test_config_types_are_locked_by_ml_collections():
  c = digits.get_config()
  with pytest.raises(TypeError):
    c.num_particles = "eight"


@pytest.mark.parametrize(
  "p,devices,expect", [(8, 8, (8, 1)), (1, 8, (1, 8)), (4, 8, (4, 2)), (16, 8, (8, 1)), (6, 4, (2, 2)), (2, 1, (1, 1))]
)
def test_mesh_shape(p, devices, expect):
  assert validation.validate(cfg(num_particles=p, global_batch_size=48 * 8), devices) == expect


def test_modes_resolve_to_one_code_path():
  ens = validation.particle_spec(cfg(mode="ensemble", temperature=3.0, correction=0.5))
  assert (ens.temperature, ens.correction, ens.resampling) == (0.0, 0.0, False)
  ddp = validation.particle_spec(cfg(mode="ddp", num_particles=1))
  assert ddp.num_particles == 1 and not ddp.resampling
  ipf = validation.particle_spec(cfg(mode="ipf", temperature=2.0, correction=0.25))
  assert (ipf.temperature, ipf.correction, ipf.resampling) == (2.0, 0.25, True)
  assert default.get_config().mode == "ipf"
  assert ipf.shared_init and not ens.shared_init
  assert validation.particle_spec(cfg(mode="ensemble", init="shared")).shared_init
  assert not validation.particle_spec(cfg(mode="ipf", init="independent")).shared_init

"""Configs that cannot work stop before compiling, naming the field and a fix."""
import pytest

from configs import default
from configs import digits
from ipf_jax import configuration
from ipf_jax.configuration import ConfigError


def cfg(**kw):
  c = digits.get_config()
  for k, v in kw.items():
    c[k] = v
  return c


@pytest.mark.parametrize("overrides,devices,field,hint", [
    (dict(num_particles=12, particle_axis_size=8), 8, "num_particles", "multiple of 8"),
    (dict(num_particles=8, global_batch_size=100), 8, "global_batch_size", "multiple of 8"),
    (dict(num_particles=4, global_batch_size=36), 8, "global_batch_size", "4 x 2"),
    (dict(mode="bayes"), 8, "mode", "ddp, ensemble, ipf"),
    (dict(temperature=-1.0), 8, "temperature", ">= 0"),
    (dict(correction=1.5), 8, "correction", "[0, 1]"),
    (dict(correction=-0.1), 8, "correction", "[0, 1]"),
    (dict(num_devices=16), 8, "num_devices", "<= 8"),
    (dict(mode="ddp"), 8, "num_particles", "num_particles=1"),
    (dict(forgetting=0.0), 8, "forgetting", "(0, 1]"),
    (dict(ess_threshold=2.0), 8, "ess_threshold", "[0, 1]"),
    (dict(lr_scaling="cubic"), 8, "lr_scaling", "none, linear, sqrt"),
    (dict(init="random"), 8, "init", "auto, shared, independent"),
    (dict(particle_axis_size=3), 8, "particle_axis_size", "divisor of 8"),
    (dict(num_train_steps=0), 8, "num_train_steps", ">= 1"),
    (dict(eval_batch_size=3, num_particles=1, global_batch_size=64), 8, "eval_batch_size", "multiple of the 8"),
])
def test_bad_config_names_field_and_fix(overrides, devices, field, hint):
  with pytest.raises(ConfigError) as e:
    configuration.validate(cfg(**overrides), devices)
  assert e.value.field == field
  assert str(e.value).startswith(f"config.{field}:")
  assert hint in str(e.value)


@pytest.mark.parametrize("p,devices,expect", [(8, 8, (8, 1)), (1, 8, (1, 8)), (4, 8, (4, 2)), (16, 8, (8, 1)),
                                              (6, 4, (2, 2)), (2, 1, (1, 1))])
def test_mesh_shape(p, devices, expect):
  assert configuration.validate(cfg(num_particles=p, global_batch_size=48 * 8), devices) == expect


def test_modes_resolve_to_one_code_path():
  ens = configuration.particle_spec(cfg(mode="ensemble", temperature=3.0, correction=0.5))
  assert (ens.temperature, ens.correction, ens.resampling) == (0.0, 0.0, False)
  ddp = configuration.particle_spec(cfg(mode="ddp", num_particles=1))
  assert ddp.num_particles == 1 and not ddp.resampling
  ipf = configuration.particle_spec(cfg(mode="ipf", temperature=2.0, correction=0.25))
  assert (ipf.temperature, ipf.correction, ipf.resampling) == (2.0, 0.25, True)
  assert default.get_config().mode == "ipf"
  assert ipf.shared_init and not ens.shared_init
  assert configuration.particle_spec(cfg(mode="ensemble", init="shared")).shared_init
  assert not configuration.particle_spec(cfg(mode="ipf", init="independent")).shared_init

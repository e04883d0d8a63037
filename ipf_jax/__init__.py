"""ipf-jax: IPF-DDP, data-parallel training of a weighted particle population in JAX.

Bring any Flax module, any per-example loss and any data; get an ensemble, a fused model and
calibrated uncertainty from one SPMD program (DESIGN.md "Library use")::

  import ipf_jax
  task = ipf_jax.classification(MyModule(num_classes=10))          # or ipf_jax.Task(model, loss, ...)
  data = ipf_jax.ArrayDataset("mine", train={"image": x, "label": y}, test={"image": xt, "label": yt})
  config = ipf_jax.default_config()                                 # every field: ipf_jax/config/defaults.py
  results = ipf_jax.train_and_evaluate(config, "runs/mine", task=task, data=data)

Public names:
  Task, classification, gaussian_regression    what is trained and how it is scored (ipf_jax.spmd.task)
  ArrayDataset, Data                           in-memory arrays, or your own batch functions (ipf_jax.data)
  default_config                               the config schema with defaults (ipf_jax.config.defaults)
  train_and_evaluate, evaluate_checkpoint      the trainer (resumable, preemption-safe; ipf_jax.runtime.trainer)
  build, Parts                                 the run's pieces: mesh, state, jitted steps (ipf_jax.config.builder)
  load_fused                                   the exported fused model as plain Flax (ipf_jax.reporting.export)

The subpackages are layers, each importing only from those below it (tests/test_layers.py):
  errors, files                            the errors users get; files written whole or not at all
  population, evaluation, data, models     the population's maths; metrics; the input; the model zoo
  spmd                                     the mesh, the state and the jitted shard_map steps
  config                                   defaults, validation, build(config) -> the run's parts
  reporting                                TensorBoard scalars, the final table, the fused model's files, pictures
  runtime                                  the trainer, checkpoints, signals, processes, the workdir, train.py's CLI
"""

__version__ = "0.3.0"

from ipf_jax.config.builder import Parts, build
from ipf_jax.config.defaults import get_config as default_config
from ipf_jax.data.arrays import ArrayDataset
from ipf_jax.data.iterators import Data
from ipf_jax.reporting.export import load_fused
from ipf_jax.runtime.trainer import evaluate_checkpoint, train_and_evaluate
from ipf_jax.spmd.task import Task, classification, gaussian_regression

__all__ = [
  "ArrayDataset",
  "Data",
  "Parts",
  "Task",
  "build",
  "classification",
  "default_config",
  "evaluate_checkpoint",
  "gaussian_regression",
  "load_fused",
  "train_and_evaluate",
]

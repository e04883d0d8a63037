"""Train a particle population with IPF-DDP.

  python train.py --config configs/digits.py --workdir runs/digits
  python train.py --config configs/digits.py --config.num_particles=1   # plain DDP
  python train.py --config configs/digits.py --config.mode=ensemble     # deep ensemble
"""
import os

import jax
from absl import app
from absl import flags
from absl import logging as absl_logging
from ml_collections import config_flags

from ipf_jax import checkpoint
from ipf_jax import configuration
from ipf_jax import trainer
from ipf_jax.data.errors import DataError

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", "runs/digits", "Directory for checkpoints, logs, config and results; "
                    "an existing one is resumed.")
flags.DEFINE_string("coordinator_address", None, "Multi-host: HOST:PORT of process 0 (jax.distributed). Without "
                    "it, SLURM, Open MPI and Cloud TPU pods are detected from the environment.")
flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes (with --coordinator_address).")
flags.DEFINE_bool("eval_only", False, "Evaluate the newest checkpoint in --workdir and print the table; no training.")
flags.DEFINE_integer("process_id", None, "Multi-host: this process's index (with --coordinator_address).")
config_flags.DEFINE_config_file("config", "configs/digits.py", "Training configuration file.",
                                lock_config=True)


def _cluster_detected() -> bool:
  """A multi-process launch that jax.distributed.initialize() detects by itself."""
  env = os.environ
  return (int(env.get("SLURM_NTASKS", "1")) > 1 or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
          or len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1)


def init_distributed() -> None:
  """Starts jax.distributed for multi-host runs; single-process runs skip it."""
  if FLAGS.coordinator_address:
    # CPU hosts talk over gloo (GPU and TPU backends bring their own collectives).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=FLAGS.coordinator_address, num_processes=FLAGS.num_processes,
                               process_id=FLAGS.process_id)
  elif _cluster_detected():
    jax.distributed.initialize()


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  absl_logging.set_verbosity(absl_logging.WARNING)  # library chatter (orbax, XLA) off; progress is ours
  trainer.setup_devices(FLAGS.config)  # before jax.distributed starts the backend
  init_distributed()
  try:
    if FLAGS.eval_only:
      trainer.evaluate_checkpoint(FLAGS.config, FLAGS.workdir)
    else:
      trainer.train_and_evaluate(FLAGS.config, FLAGS.workdir)
  except (configuration.ConfigError, checkpoint.CheckpointError, trainer.NonFiniteError, trainer.WorkdirError,
          DataError) as e:
    raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
  app.run(main)

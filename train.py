"""Train a particle population with IPF-DDP.

  python train.py --config configs/digits.py --workdir runs/digits
  python train.py --config configs/digits.py --config.num_particles=1   # plain DDP
  python train.py --config configs/digits.py --config.mode=ensemble     # deep ensemble
"""
from absl import app
from absl import flags
from ml_collections import config_flags

from ipf_jax import configuration
from ipf_jax import trainer

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", "runs/digits", "Directory for logs, config and results.")
config_flags.DEFINE_config_file("config", "configs/digits.py", "Training configuration file.",
                                lock_config=True)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  try:
    trainer.train_and_evaluate(FLAGS.config, FLAGS.workdir)
  except (configuration.ConfigError, trainer.NonFiniteError) as e:
    raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
  app.run(main)

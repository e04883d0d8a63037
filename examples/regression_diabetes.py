"""Regression with a Gaussian likelihood head on scikit-learn's diabetes data (442 patients, 10 features).

  python examples/regression_diabetes.py --workdir runs/diabetes [--mode ensemble|ipf] [--particles 8]

The model outputs a mean and a scale per example; the loss is the Gaussian
negative log-likelihood. The ensembles are mixtures of the particles'
Gaussians (weighted, and uniform), the fused model averages the parameters.
The table reports NLL and RMSE on a fixed 25% test split, in units of the
standardised target; RMSE is also printed in the target's own units.
"""

import argparse

import flax.linen as nn
import numpy as np
from sklearn.datasets import load_diabetes
from sklearn.model_selection import train_test_split

import ipf_jax


class GaussianMLP(nn.Module):
  """Two hidden layers; outputs (mean, raw scale) per example."""

  hidden: int = 32

  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.relu(nn.Dense(self.hidden)(x))
    x = nn.relu(nn.Dense(self.hidden)(x))
    return nn.Dense(2)(x)


def load():
  """Fixed 75/25 split; features and target standardised with the training statistics."""
  x, y = load_diabetes(return_X_y=True)
  x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=0)
  mx, sx, my, sy = x_tr.mean(0), x_tr.std(0), y_tr.mean(), y_tr.std()
  f = lambda a: a.astype(np.float32)
  data = ipf_jax.ArrayDataset(
    "diabetes",
    train={"x": f((x_tr - mx) / sx), "y": f((y_tr - my) / sy)},
    test={"x": f((x_te - mx) / sx), "y": f((y_te - my) / sy)},
  )
  return data, sy


def config_for(mode="ipf", particles=8, steps=150, seed=0):
  config = ipf_jax.default_config()
  config.mode, config.num_particles, config.num_cpu_devices = mode, particles, particles
  config.global_batch_size, config.num_train_steps, config.seed = 8 * particles, steps, seed
  config.base_lr, config.weight_decay, config.log_every_steps = 0.2, 1e-4, 100
  config.grad_clip_norm = 1.0  # a Gaussian NLL's gradient explodes when a scale collapses; without it DDP diverged
  config.temperature = 1.0  # losses are per-example NLLs of order 1
  return config


def main(workdir, mode="ipf", particles=8, steps=150, seed=0):
  data, y_scale = load()
  results = ipf_jax.train_and_evaluate(
    config_for(mode, particles, steps, seed), workdir, task=ipf_jax.gaussian_regression(GaussianMLP()), data=data
  )
  for row in ("ensemble", "fused"):
    print(
      f"{row}: NLL {results[row]['nll']:.4f}, RMSE {results[row]['rmse']:.4f} "
      f"({results[row]['rmse'] * y_scale:.1f} in the target's units)"
    )
  return results


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workdir", default="runs/diabetes")
  parser.add_argument("--mode", default="ipf", choices=["ddp", "ensemble", "ipf"])
  parser.add_argument("--particles", type=int, default=8)
  parser.add_argument("--steps", type=int, default=150)
  parser.add_argument("--seed", type=int, default=0)
  return parser.parse_args(argv)


if __name__ == "__main__":
  args = parse_args()
  main(args.workdir, args.mode, args.particles if args.mode != "ddp" else 1, args.steps, args.seed)

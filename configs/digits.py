"""IPF-DDP on scikit-learn's handwritten digits, on the CPU.

  python train.py --config configs/digits.py --workdir runs/digits

8 particles, one per (fake) CPU device, a small CNN, 1347 train / 450 test
images (fixed 75/25 split). 108 s on 2 shared CPU cores (measured 2026-12-07); see
README.md for the accuracy it reaches.
"""

from ipf_jax.config import defaults


# The comments stand in one column, a continued one under its first line: not reformatted.
# fmt: off

def get_config():
  config = defaults.get_config()
  config.dataset = "digits"
  config.model = "cnn"
  config.num_particles = 8
  config.global_batch_size = 128
  config.num_train_steps = 300
  config.num_cpu_devices = 8           # show the real particle mesh on a CPU-only machine
  config.jitter_lr = 0.3               # resample-move noise sigma = 0.3 x learning rate on resampled copies:
                                       # measured on digits (BENCHMARKS.md, "Uncertainty on digits"); its scale is
                                       # absolute, so other models choose their own (the library default is 0)
  return config

"""ResNet-18 (CIFAR stem) on CIFAR-100: configs/cifar10_r18.py with 100 classes.

python train.py --config configs/cifar100_r18.py --workdir runs/cifar100_r18 --config.data_dir=/path/to/tfds
"""

try:  # a checkout's configs/ or the copy installed as ipf_jax.configs
  from configs import cifar10_r18
except ImportError:
  from ipf_jax.configs import cifar10_r18


def get_config():
  config = cifar10_r18.get_config()
  config.dataset = "cifar100"
  return config

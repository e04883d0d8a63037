"""ResNet-18 (CIFAR stem) on CIFAR-10 with IPF-DDP: 8 particles, 200 epochs.

  python train.py --config configs/cifar10_r18.py --workdir runs/cifar10_r18 --config.data_dir=/path/to/tfds

Needs TFDS's cifar10 prepared in data_dir (`tfds build cifar10`). Not yet run
by this project; a single ResNet-18 with this recipe is usually reported at
about 95% test accuracy.
Not measured at this scale. On Fashion-MNIST at equal compute no population setting beat a DDP with a tuned
learning rate (BENCHMARKS.md, "The outer loop"): for one accurate model, --config.mode=ddp.
"""

from ipf_jax.config import defaults


def get_config():
  config = defaults.get_config()
  config.dataset = "cifar10"
  config.image_size = 32
  config.model = "resnet18"
  config.small_inputs = True
  config.num_particles = 8
  config.global_batch_size = 512
  config.eval_batch_size = 1000
  config.num_epochs = 200.0
  config.warmup_epochs = 5.0
  config.base_lr = 0.1
  config.lr_scaling = "linear"
  config.reference_batch_size = 128
  config.weight_decay = 5e-4
  config.log_every_steps = 100
  config.checkpoint_every_steps = 1000
  return config

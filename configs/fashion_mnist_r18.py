"""ResNet-18 (CIFAR stem) on Fashion-MNIST with IPF-DDP: 8 particles, 30 epochs.

  apt-get install dataset-fashion-mnist
  python -m ipf_jax.data.prepare fashion_mnist --data_dir ~/tensorflow_datasets
  python train.py --config configs/fashion_mnist_r18.py --workdir runs/fashion_mnist_r18

ResNet-18 with the 3x3 stem and no max-pool (``small_inputs``), 11.2M
parameters, on 28x28x1 images with pad-4 random crop + horizontal flip;
global batch 512, SGD with Nesterov momentum, 2 warmup epochs then cosine.
The published reference for this class (the dataset's README): ResNet-18
with flips, translation and rotation, 94.9%. Not yet trained by this project:
on this project's 2-core CPU machine one step takes 22 s (23 images/s,
benchmarks/fashion_mnist_input.py), so its 3,510 steps would take 21 hours;
it is meant for a GPU.
"""

from ipf_jax.config import defaults


def get_config():
  config = defaults.get_config()
  config.dataset = "fashion_mnist"
  config.image_size = 28
  config.model = "resnet18"
  config.small_inputs = True
  config.num_particles = 8
  config.global_batch_size = 512
  config.eval_batch_size = 1000
  config.num_epochs = 30.0
  config.warmup_epochs = 2.0
  config.base_lr = 0.1
  config.lr_scaling = "linear"
  config.reference_batch_size = 128
  config.weight_decay = 5e-4
  config.log_every_steps = 100
  config.checkpoint_every_steps = 1000
  return config

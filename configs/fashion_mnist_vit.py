"""A small ViT population on Fashion-MNIST: ViT-Ti with 4 x 4 patches (49 tokens and a class token), AdamW.

  python -m ipf_jax.data.prepare fashion_mnist --data_dir ~/tensorflow_datasets   # once (see fashion_mnist.py)
  python train.py --config configs/fashion_mnist_vit.py --workdir runs/fashion_mnist_vit

The same data, batch (8 particles x 16), epochs and augmentation as configs/fashion_mnist.py; the model is
vit_ti16 at patch size 4 (5.4M parameters per particle), AdamW at 1e-3 with 500 warmup steps, decoupled
weight decay 0.05, clipping at 1.0, stochastic depth 0.1. On a CPU it is slow (it is a ViT): meant for a GPU,
or as a recipe to start from. Measured on this project's 2-core machine (commit 32962d0, sharing the cores with
one other run; `... --config.num_epochs=0 --config.num_train_steps=60 --config.log_every_steps=20` added to the
command above): 60 steps in 5 min 50 s with compilation, then 0.3 steps/s, so the 2,340 steps of 5 epochs take
over 2 hours, and the final evaluation on the 10,000 test images several minutes more. No accuracy is claimed
for it: it has not been trained to the end here. The recipe at a CPU's size (width 64, depth 6, 7 x 7 patches,
this file's optimizer) is measured in BENCHMARKS.md, "A small ViT on Fashion-MNIST at equal compute":
DDP 79.4%, ipf 70.9-76.6% after 5 epochs.
"""

try:  # a checkout's configs/ or the copy installed as ipf_jax.configs
  from configs import fashion_mnist
except ImportError:
  from ipf_jax.configs import fashion_mnist


def get_config():
  config = fashion_mnist.get_config()
  config.model = "vit_ti16"
  config.vit_patch_size = 4
  config.stochastic_depth = 0.1
  config.optimizer = "adamw"
  config.base_lr, config.lr_scaling = 1e-3, "linear"  # AdamW's rate, scaled (fashion_mnist.py's CNN rate is not)
  config.reference_batch_size = 128
  config.warmup_steps = 500
  config.weight_decay = 0.05
  config.grad_clip_norm = 1.0
  return config

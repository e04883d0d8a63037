"""ViT-S/16 on ImageNet with IPF-DDP, big_vision's ``configs/vit_s16_i1k.py`` recipe field by field.

  python train.py --config configs/imagenet_vit_s16.py --workdir runs/imagenet_vit_s16 --config.data_dir=/path/to/tfds

big_vision's recipe and this config's fields (8 particles x 128 images = its batch of 1,024):
  ViT-S/16, global-average pooling, fixed 2-d sin-cos position embedding   model, vit_pool, vit_posemb
  batch 1024, 90 epochs                                                      global_batch_size, num_epochs
  scale_by_adam, first moment in bfloat16                                    optimizer=adamw, mu_dtype
  lr 1e-3, 10k warmup steps, then cosine to 0                                base_lr, warmup_steps
  decoupled weight decay 1e-4 on kernels, not multiplied by the lr           weight_decay=0.1: optax's adamw
                                                                             multiplies it by the lr (1e-3)
  gradient clipping at global norm 1.0                                       grad_clip_norm
  head initialised to zeros                                                  (the zoo's ViT always)
  mixup p = 0.2 (one ratio for the whole batch; here one per particle)       mixup
  RandAugment(2, 10)                                                         randaugment_layers, _magnitude
  inception crop (8-100% of the area) + flip                                 (the pipeline's ImageNet crop)
Not here yet: big_vision's sigmoid cross-entropy (this task is softmax's). Published anchors for the recipe (big_vision,
not measured here: no ImageNet machine): 76.5% top-1 at 90 epochs, 78.5% at 150, 80.0% at 300 for one model;
"6-7h on a TPU-v3-8" for 90 epochs. Each particle here sees 128 images per step, not 1,024.
Not measured at this scale. On Fashion-MNIST at equal compute no population setting beat a DDP with a tuned
learning rate (BENCHMARKS.md, "The outer loop"): for one accurate model, --config.mode=ddp.
"""

from ipf_jax.config import defaults


def get_config():
  config = defaults.get_config()
  config.dataset = "imagenet2012"
  config.image_size = 224
  config.model = "vit_s16"
  config.vit_pool = "gap"
  config.vit_posemb = "sincos2d"
  config.dtype = "bfloat16"
  config.num_particles = 8
  config.global_batch_size = 1024
  config.eval_batch_size = 1000
  config.num_epochs = 90.0
  config.optimizer = "adamw"
  config.mu_dtype = "bfloat16"
  config.b1, config.b2 = 0.9, 0.999
  config.base_lr = 1e-3  # at the batch of 1,024 ...
  config.reference_batch_size = 1024
  config.lr_scaling = "linear"  # ... and linear in it
  config.warmup_steps = 10_000
  config.weight_decay = 0.1  # x lr 1e-3 = big_vision's 1e-4 at the peak; both follow the schedule's shape
  config.grad_clip_norm = 1.0
  config.randaugment_layers, config.randaugment_magnitude = 2, 10.0
  config.mixup = 0.2  # the particle's batch, in the step (big_vision: the global batch)
  config.log_every_steps = 100
  config.eval_every_steps = 5000
  config.checkpoint_every_steps = 2500
  return config

"""ResNet-50 on ImageNet with IPF-DDP: 8 particles, 90 epochs.

  python train.py --config configs/imagenet_r50.py --workdir runs/imagenet_r50 --config.data_dir=/path/to/tfds

Needs TFDS's imagenet2012 prepared in data_dir from the manual download
(ILSVRC2012_img_{train,val}.tar in DATA_DIR/downloads/manual, then
`tfds build imagenet2012 --data_dir=DATA_DIR`).

What to expect (published anchors, not measured here: this project has had no
ImageNet-capable machine yet): a single ResNet-50 with this recipe reaches
about 76.2-76.7% top-1; a deep ensemble of 4 about 77.9% top-1, NLL 0.857,
ECE 0.017. On 8 GPUs each particle trains on its own GPU (mesh (8, 1)) with
128 images per step; with 8 x bf16 particles expect roughly DDP's images/s
(see BENCHMARKS.md for what was measured). GPUs without bfloat16 (V100, T4):
add --config.dtype=float16 (float16 compute with dynamic loss scaling).
Not measured at this scale. On Fashion-MNIST at equal compute no population setting beat a DDP with a tuned
learning rate (BENCHMARKS.md, "The outer loop"): for one accurate model, --config.mode=ddp.
"""

from ipf_jax.config import defaults


def get_config():
  config = defaults.get_config()
  config.dataset = "imagenet2012"
  config.image_size = 224
  config.model = "resnet50"
  config.dtype = "bfloat16"  # float16 (with dynamic loss scaling) on GPUs without bf16
  config.num_particles = 8
  config.global_batch_size = 1024  # 8 particles x 128
  config.eval_batch_size = 1000  # 50,000 validation images, last batch padded and masked
  config.num_epochs = 90.0
  config.warmup_epochs = 5.0
  config.base_lr = 0.1  # per 256 examples ...
  config.lr_scaling = "linear"  # ... scaled linearly with the global batch
  config.reference_batch_size = 256
  config.momentum = 0.9
  config.nesterov = True
  config.weight_decay = 1e-4  # not on BatchNorm or biases
  config.label_smoothing = 0.0  # 0.1 is a common variant
  config.log_every_steps = 100
  config.eval_every_steps = 5000
  config.checkpoint_every_steps = 2500
  config.shuffle_buffer = 16_384
  return config

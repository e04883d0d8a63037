"""The configuration schema: every field a run reads, with its default and meaning.

Configs (``configs/*.py``, or your own) start from ``get_config()`` here and
override a few fields. Any field can be overridden on the command line:
``--config.num_particles=4``.
"""

import ml_collections


# The comments stand in one column, a continued one under its first line: not reformatted.
# fmt: off

def get_config() -> ml_collections.ConfigDict:
  """Every field with its default, locked: a misspelt override is an error naming the closest field."""
  config = ml_collections.ConfigDict()
  for section in SECTIONS:
    section(config)
  config.lock()
  return config


def _run(config: ml_collections.ConfigDict) -> None:
  """Run: how long it trains, how often it logs, evaluates and saves."""
  config.seed = 0                      # PRNG seed: particle init, resampling, data order
  config.num_train_steps = 300         # train steps (one global batch each)
  config.num_epochs = 0.0              # if > 0: train this many epochs instead of num_train_steps
  config.log_every_steps = 25          # progress line every N steps
  config.eval_every_steps = 0          # evaluate every N steps (0 = only at the end)
  config.checkpoint_every_steps = 100  # save the whole state every N steps and at the end (0 = only at the end,
                                       # -1 = never: no resuming)
  config.checkpoint_every_minutes = 30.0  # also save when this much wall time passed since the last save (for
                                       # sessions that end without a signal, e.g. Colab; 0 = off)
  config.time_limit_minutes = 0.0      # stop cleanly (save, exit code 75) after this much wall time (0 = none)
  config.keep_checkpoints = 3          # keep the newest K checkpoints
  config.async_checkpointing = True    # write checkpoints in the background while training goes on
  config.rewind = False                # go back to the newest checkpoint when training diverges and skip the
                                       # batches read since (docs/RUNNING.md "Rewind on divergence")
  config.rewind_window = 20            # rewind: the loss's moving average (over about this many steps) must stay
                                       # above rewind_loss_factor x its lowest for this many steps
  config.rewind_loss_factor = 2.0      # rewind: how far above its lowest the loss's moving average may go
  config.rewind_accuracy_drop = 0.0    # rewind: also when the periodic evaluation's accuracy falls this many
                                       # points below the run's best (0 = off)
  config.rewind_max = 3                # rewind: at most this many in a run, then it stops with an error
  config.rewind_lr_factor = 1.0        # rewind: the learning rate is multiplied by this at each rewind (the
                                       # schedule times factor ** rewinds; 1: kept, as PaLM kept it)
  config.trackers = "tensorboard"      # where the run's scalars go, comma-separated: tensorboard | mlflow (its
                                       # server from MLFLOW_TRACKING_URI) | wandb (WANDB_MODE, WANDB_PROJECT);
                                       # mlflow and wandb also get the config as parameters and, at the
                                       # end, the fused model, results and pictures as artifacts


def _data(config: ml_collections.ConfigDict) -> None:
  """Data: the dataset, the batch, the evaluation sets."""
  config.dataset = "digits"            # digits (scikit-learn, embedded) | imagenet2012 | cifar10 | cifar100 |
                                       # fashion_mnist (TFDS; fashion_mnist from Debian: python -m ipf_jax.data.prepare)
  config.data_dir = ""                 # TFDS data_dir holding the prepared dataset ("" = TFDS default)
  config.image_size = 224              # TFDS datasets: training/eval crop size
  config.shuffle_buffer = 16_384       # TFDS datasets: examples in the shuffle buffer
  config.global_batch_size = 128       # G: examples per step (one update), over all particles and devices
  config.eval_batch_size = 256         # per eval step (rounded up to a multiple of the devices; padded, masked;
                                       # a smaller set is one batch of its own size)
  config.train_fraction = 1.0          # embedded datasets: train on this fixed random fraction of the train split
  config.label_noise = 0.0             # embedded datasets: this fraction of train labels replaced by another class
  config.calibration_fraction = 0.0    # hold out this fraction of the train split (in-memory datasets) to fit
                                       # one temperature per ensemble / fused model on it; the final table shows
                                       # test NLL, ECE and Brier before and after (0 = off)
  config.eval_shifts = ""              # shifted test sets for the final evaluation: "" | all | a comma list.
                                       # digits: gaussian_noise, blur, rotation, translation, contrast (severities
                                       # 1-5; the same on fashion_mnist); cifar10: CIFAR-10-C corruptions, cifar10_1;
                                       # imagenet2012: ImageNet-C corruptions, imagenet_v2, imagenet_a, imagenet_r
                                       # (prepared TFDS data)
  config.shift_examples = 0            # > 0: each shifted set (and the in-memory OOD sets) is the first N images of
                                       # the test set, not all of it (an evaluation of 25 shifted sets of 10,000
                                       # costs 25 test-set evaluations; 0 = all)
  config.ood_dataset = ""              # out-of-distribution sets for OOD AUROC, comma-separated: "" | photos
                                       # (digits: 8x8 patches of scikit-learn's sample photos) | fashion_mnist: digits
                                       # (sklearn's, upscaled to 28x28), photos (28x28 patches) | a prepared TFDS
                                       # image dataset


def _model(config: ml_collections.ConfigDict) -> None:
  """Model: the model zoo and the compute dtype."""
  config.model = "cnn"                 # cnn | resnet18 | resnet34 | resnet50 | resnet101 | resnet152 | resnet_tiny
                                       # | vit_ti16 | vit_s16 | vit_b16 | vit_l16 | vit_h14 | vit_g14
  config.cnn_features = (32, 64, 128)  # channels of the cnn's conv stages
  config.small_inputs = False          # resnets: 3x3 stem without max-pool, for 32x32 images
  config.remat = False                 # resnets, vits: recompute each block in the backward pass (less memory)
  config.vit_patch_size = 0            # vits: patch size (0 = the name's: 16 for vit_b16; e.g. 4 on 28x28)
  config.vit_pool = "tok"              # vits: tok (a class token, the original ViT) | gap (mean over tokens)
  config.vit_posemb = "learn"          # vits: learn | sincos2d (fixed 2-d sin-cos, big_vision's i1k recipe)
  config.vit_scan = False              # vits: the encoder blocks as one nn.scan (one block compiled, not depth;
                                       # parameters stacked [depth, ...]; with remat, one block recomputed at a time)
  config.dropout = 0.0                 # vits: dropout after attention, in the MLP and on the embeddings
  config.stochastic_depth = 0.0        # vits: the last block's residual drop rate, rising linearly from 0
  config.dtype = "float32"             # compute dtype: float32 | bfloat16 | float16 (params and optimizer stay
                                       # float32; float16, for GPUs without bfloat16, uses dynamic loss scaling)
  config.loss_scale_init = 65536.0     # float16: initial loss scale (a power of 2)
  config.loss_scale_growth_interval = 2000  # float16: double the loss scale after this many finite steps
  config.bn_momentum = 0.9             # BatchNorm running-average momentum


def _optimiser(config: ml_collections.ConfigDict) -> None:
  """Optimiser: schedule, the optimizer and its fields, regularisation."""
  config.base_lr = 0.1                 # learning rate at reference_batch_size
  config.lr_scaling = "linear"         # none | linear | sqrt, on G / reference_batch_size; seed: the seed's rule
                                       # base_lr * sqrt(devices * num_particles), whatever the batch
  config.reference_batch_size = 256    # batch size at which base_lr applies
  config.warmup_steps = 20             # linear warmup, then cosine decay to 0
  config.warmup_epochs = 0.0           # if > 0: warmup length in epochs instead of warmup_steps
  config.label_smoothing = 0.0         # cross-entropy label smoothing
  config.label_smoothing_spread = 0.0  # > 0: per-particle label smoothing (PAPA): particle slot i of P smooths by
                                       # label_smoothing + spread * i / (P - 1), so members differ in how they
                                       # regularise; label_smoothing + spread < 1
  config.randaugment_layers = 0        # TFDS data: RandAugment(layers, magnitude) in tf.data after the crop
  config.randaugment_magnitude = 10.0  # and flip (big_vision's ViT recipe: 2, 10); 0 layers = off
  config.mixup = 0.0                   # > 0: mixup in the step, ratio ~ Dirichlet(mixup, mixup) (big_vision: 0.2)
  config.mixup_spread = 0.0            # > 0: per-particle mixup (PAPA): slot i mixes with concentration
                                       # mixup + spread * i / (P - 1) (0: that particle does not mix)
  config.grad_accum_steps = 1          # k: each step's global batch runs as k micro-batches of G / k (activation
                                       # memory of G / k), gradients and losses averaged, then one filter step
                                       # and one update (1 = off)
  config.optimizer = "sgd"             # one particle's: sgd | adamw | lamb | lion | adafactor (optax's); any
                                       # other optax transformation through the library (build(..., tx=...))
  config.momentum = 0.9                # sgd: momentum
  config.nesterov = True               # sgd: Nesterov momentum
  config.b1 = 0.9                      # adamw, lamb: first-moment decay; lion: its update's interpolation
  config.b2 = 0.999                    # adamw, lamb: second-moment decay; lion: its momentum's decay (its
                                       # paper's 0.99)
  config.eps = 1e-8                    # adamw, lamb: added to the denominator
  config.mu_dtype = ""                 # adamw, lion: the first moment's dtype ("" = the parameters'; bfloat16
                                       # halves its memory, as big_vision's ViT recipe does)
  config.weight_decay = 1e-4           # on kernels only (not BN, not biases, not embeddings' 1-d leaves). sgd:
                                       # L2, wd * theta added before the momentum; adamw, lamb, lion: decoupled,
                                       # theta -= lr * wd * theta (optax's); adafactor: its weight_decay_rate
  config.grad_clip_norm = 0.0          # clip each particle's gradient by global norm (0 = off)


def _particles(config: ml_collections.ConfigDict) -> None:
  """Particles: the population and the filter (docs/DESIGN.md §3)."""
  config.mode = "ipf"                  # ddp | ensemble | ipf (see README, "Modes")
  config.num_particles = 8             # P; 1 = plain DDP in any mode
  config.shared_params = ""            # regex of parameter paths stored once and shared by all particles, e.g.
                                       # "^(conv_init|bn_init|stage1_)" (stem + first stage); "" = none
  config.init_from = ""                # start every particle from one checkpoint: an exported fused model, a
                                       # run's workdir (its fused model), a Flax msgpack or a .npz of
                                       # /-joined names ("" = from config.init)
  config.init_particle = -1            # init_from a run's workdir: >= 0 that particle of its newest checkpoint
                                       # instead of its fused model
  config.init_reinit = ""              # init_from: regex of parameter paths initialised fresh (per particle,
                                       # as config.init says) instead of loaded, e.g. "^head/"
  config.init = "auto"                 # auto | shared | independent: one init for all particles (fusion needs it)
                                       # or one per particle (deep ensemble); auto = independent in ensemble mode
  config.temperature = 10.0            # tau >= 0: log w <- rho log w - tau loss (10: best fused model and NLL
                                       # in the digits study, BENCHMARKS.md)
  config.forgetting = 0.9              # rho in [0, 1]: memory of past losses in the weights (0: this step's loss
                                       # only, the seed's rule w = softmax(-tau loss))
  config.weigh_on = "own"              # own: a particle's weight from its loss on its own examples | common: from
                                       # its loss on common_examples of every particle's examples, the same for
                                       # all (a forward pass on P x common_examples more examples per particle)
  config.common_examples = 2           # weigh_on=common: examples taken from each particle's part of the batch
  config.ess_target = 0.0              # > 0: each step, tau_t = the largest tau <= temperature whose reweighting
                                       # keeps ESS >= ess_target * P (bisection, as adaptive tempered SMC; 0 = off)
  config.correction = 0.5              # lambda in [0, 1]: pull towards the weighted consensus gradient (sync=step;
                                       # the outer loop averages parameters at syncs instead)
  config.elastic_pull = 0.0            # alpha in [0, 1]: after each update theta_i += alpha (theta_bar - theta_i),
                                       # theta_bar = sum_i w_i theta_i (ipf mode; 0 = off)
  config.elastic_pull_every = 1        # the elastic pull on every k-th step only: alpha 0.1 every 100 steps is
                                       # about PAPA's gentle 0.001 a step, at one all-reduce of the parameters
                                       # per k steps
  config.ess_threshold = 0.5           # resample when ESS < ess_threshold * P (islands: any island's ESS
                                       # below ess_threshold * P / islands)
  config.islands = 1                   # G dividing P: groups of P / G particles, each weighed (an equal share of
                                       # the total) and resampled within itself, so G lineages survive (1 = one
                                       # population; G = P: equal weights, culled members replaced)
  config.resample_every = 0            # also resample every N steps (0 = only on low ESS)
  config.compress_correction = False   # exchange the consensus gradient as int8 blocks with error feedback
  config.jitter = 0.0                  # sigma of Gaussian noise added to resampled copies
  config.jitter_lr = 0.0               # plus this times the step's learning rate (resample-move noise that
                                       # shrinks with the schedule; 0 = off)
  config.resample_exchange = "auto"    # how resampled particles move between devices: all_to_all (one
                                       # collective of P particles) | rounds (one-particle ppermute rounds,
                                       # only those needed) | ragged (one ragged_all_to_all per leaf; GPU/TPU
                                       # only, not yet run on one) | auto (= rounds: BENCHMARKS.md "Scaling")
  config.resample_placement = "ascending"  # which freed slot takes which copy: ascending (the copies in
                                       # ancestor order; the same on any mesh) | local (on the copy's own
                                       # device first, then the rounds that fill the most slots: fewer
                                       # rounds across devices, never more; each particle's expected copies
                                       # unchanged, but the run depends on the particle mesh;
                                       # BENCHMARKS.md "Placing the copies")

  config.fused_bn_batches = 0          # > 0: re-estimate the fused model's BatchNorm statistics on this many
                                       # train batches before evaluating and exporting it (0 = weighted average)

  config.particle_loop = "auto"        # vmap | map | unroll | auto (measured best: unroll on GPUs, else vmap)


def _outer(config: ml_collections.ConfigDict) -> None:
  """The outer loop (docs/DESIGN.md §3b): local steps between syncs, the filter and the average at syncs."""
  config.sync = "auto"                 # auto: qsr for a population in ipf mode (ahead of step at every batch
                                       # measured, BENCHMARKS.md), step otherwise or when the run asks for what
                                       # only step does (elastic_pull, resample_every, shared_params, fsdp,
                                       # compress_correction, float16, a changed correction, temperature or
                                       # weigh_on) | step: weigh, correct (correction,
                                       # elastic_pull) and resample every step (DESIGN.md §3, the seed's reading)
                                       # | every | qsr | swap: the outer loop (§3b): plain local steps, the
                                       # average (weighed at sync_temperature) at syncs (mode=ddp with every |
                                       # qsr: one model, the outer optimizer: Lookahead)
  config.sync_every = 4                # every: sync each H steps; qsr: H_base (4: the measured qsr arm,
                                       # BENCHMARKS.md "The outer loop")
  config.sync_qsr_alpha = 0.25         # qsr: after a sync the next comes max(H_base, floor((alpha peak_lr / lr)^2))
                                       # steps later (Gu et al., ICLR 2024): rarer as the learning rate decays
                                       # (relative to the peak: the same value for SGD's rates and AdamW's)
  config.sync_swap_fraction = 0.5      # swap: sync every step for this fraction of the run, then never (SWAP)
  config.sync_pull = 1.0               # gamma in [0, 1]: at a sync theta_i += gamma (anchor - theta_i) (1: local
                                       # SGD, every particle becomes the anchor; the last step never pulls)
  config.sync_temperature = 0.0        # tau at a sync: log w <- rho log w - tau loss on the common examples (0: the
                                       # uniform mean, the measured best; > 0: the filter at syncs, adapted to
                                       # ess_target when set; the per-step filter's tau is temperature)
  config.sync_examples = 32            # at a sync every particle is weighed on these many examples of each
                                       # particle's part of the batch (at most that part; P x this in all)
  config.sync_opt_state = "keep"       # keep | reset | average: each particle's optimizer state at a sync
  config.outer_lr = 1.0                # the anchor's outer SGD on anchor - weighted mean (1 and no momentum: the
                                       # anchor is the mean; DiLoCo: 0.7 with outer_momentum 0.9)
  config.outer_momentum = 0.0          # its Nesterov momentum (0 = none)


def _devices(config: ml_collections.ConfigDict) -> None:
  """Devices: the mesh (docs/DESIGN.md §2)."""
  config.num_devices = 0               # devices to use (0 = all)
  config.particle_axis_size = 0        # Dp, size of the "particle" mesh axis (0 = gcd(P, devices))
  config.fsdp = False                  # shard each particle's parameters and optimizer state over the Dd devices
                                       # of its group, gathered for the forward pass (docs/RUNNING.md "Devices,
                                       # batch and learning rate"); sgd, adamw, lion; not with float16 or
                                       # compress_correction
  config.fsdp_min_size_mb = 1.0        # fsdp: leaves of at least this many MiB per particle are sharded, along
                                       # their largest dimension that Dd divides; smaller ones stay whole
                                       # (big_vision's min_size_to_shard_mb, whose 4 would leave ViT-B's 2.25 MiB
                                       # attention kernels whole: 0.43 of the state per device at Dd = 8, not 0.13)
  config.fsdp_gather = "particle"      # fsdp: "particle" gathers the whole particle for the forward pass; "block"
                                       # leaves the zoo models' blocks (ViT encoder blocks, ResNet blocks:
                                       # Task.blocks) to gather their own as they run, so that under remat (it
                                       # needs remat=True) a device holds one block whole, not the particle. With
                                       # the ViT's blocks scanned (vit_scan) it lowers the compiled peak (ViT-B/16
                                       # at Dd=8 on XLA:CPU: 0.42x); unrolled it does not (BENCHMARKS.md
                                       # "Gathering block by block under remat")
  config.num_cpu_devices = 0           # on a CPU-only host, split the CPU into N devices (0 = leave)


SECTIONS = (_run, _data, _model, _optimiser, _particles, _outer, _devices)  # get_config's order; docs/CONFIG.md's
# fmt: on

# Each field's kind on resume, the schema's one description of it (read by the resume checks,
# runtime/compatibility.py, and docs/CONFIG.md's "on resume" column):
# - HOW: how a run is run (logging, saving, devices, what the evaluation adds), not what it trains: a resume may
#   change it without a word. Another mesh or loop changes results only by float rounding.
# - IDENTITY: which method trained the population, from what start: a resume that changes one would continue
#   another run under this run's name (a finished ipf run evaluated as the ensemble the command asked for), so
#   it is refused even when the state's shapes agree.
# - every other field: a resume may change it if the saved state fits, and the change is listed.
HOW = frozenset(
  {
    "log_every_steps",
    "trackers",
    "rewind",
    "rewind_window",
    "rewind_loss_factor",
    "rewind_accuracy_drop",
    "rewind_max",
    "rewind_lr_factor",
    "eval_every_steps",
    "checkpoint_every_steps",
    "checkpoint_every_minutes",
    "time_limit_minutes",
    "keep_checkpoints",
    "async_checkpointing",
    "data_dir",
    "eval_batch_size",
    "eval_shifts",
    "shift_examples",
    "ood_dataset",
    "fused_bn_batches",
    "particle_loop",
    "num_devices",
    "particle_axis_size",
    "num_cpu_devices",
  }
)
IDENTITY = ("mode", "num_particles", "init", "init_from", "init_particle", "init_reinit", "weigh_on", "sync")
# config.trackers' names, each with the package it needs (pyproject.toml's extra of the same name; validation checks it)
TRACKERS = {"tensorboard": None, "mlflow": "mlflow", "wandb": "wandb"}


def on_resume(field: str) -> str:
  """What a resume that changes ``field`` does, in words (docs/CONFIG.md)."""
  return "silent" if field in HOW else "refused" if field in IDENTITY else "listed"

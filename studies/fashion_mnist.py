"""Fashion-MNIST at equal compute (issue: Real data): DDP, deep ensemble, ipf, through the TFDS pipeline.

  apt-get install dataset-fashion-mnist && python -m ipf_jax.data.prepare fashion_mnist --data_dir DIR
  python -m studies.fashion_mnist --data_dir DIR [--seeds 3] [--epochs 5] [--batch 128]
         [--methods ddp,...] [--shift_examples 500] [--eval_every_epochs 1] [--out rows.jsonl] [--picture c.png]
         [--vit 64,6,4,7]   # a small ViT (width, depth, heads, patch) with configs/fashion_mnist_vit.py's recipe

``configs/fashion_mnist.py`` as a user runs it (TFDS's fashion_mnist prepared
from Debian's files, pad-4 crop + flip, the CNN (32, 64, 128), 8 fake CPU
devices), once per (method, seed), each method with the same devices, global
batch and steps (equal compute: 8 models on 16 examples each per step, or DDP's
one model on all 128). Each run is evaluated on the 10,000 test images, on the
five corruptions at severities 1-5 (``eval_shifts=all``; the first
``--shift_examples`` test images of each) and against two OOD sets (sklearn's
digits at 28 x 28 and photo patches, ``ood_dataset=digits,photos``). Columns:
the ensemble's (ddp: its model's) accuracy, NLL, ECE, Brier; the single model's
(ipf: the fused model; ensemble: its mean member) accuracy and NLL; the
ensemble's accuracy and ECE under the corruptions (mean over the 25 sets); OOD
AUROC by the ensemble's maximum probability for each OOD set; disagreement;
resamplings per step; the test accuracy after each epoch (``curve``, from
``eval_every_steps``), the first epoch at which the ensemble reaches DDP's final
accuracy (mean over DDP's seeds) as a fraction of the run, and the standard
deviation of the per-step training loss over the last 40% of steps. Each run's
row is appended to ``--out`` (JSON lines) as soon as it ends, so a stopped study
keeps what it measured; ``--resume`` skips the rows already there. ``--vit
W,D,H,P`` trains the zoo's ViT at width W, depth D, H heads, patch P (MLP 4W)
instead of the CNN, with ``configs/fashion_mnist_vit.py``'s AdamW recipe (issue:
ViTs, study 5a): the library path, the model given as a ``Task``. A
benchmark, not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import commit, print_summary  # noqa: E402
from configs import fashion_mnist, fashion_mnist_vit  # noqa: E402
from ipf_jax.config import builder  # noqa: E402
from ipf_jax.reporting import report  # noqa: E402
from ipf_jax.runtime import trainer  # noqa: E402
from ipf_jax.spmd.task import Task  # noqa: E402

# The digits study's most diverse population (BENCHMARKS.md, "Ten seeds on another machine"): correction=0,
# islands=4, init=independent, jitter_lr=0.3, ess_threshold=0.75. No fused model (independent inits), so its
# single-model columns are not comparable.
DIGITS_BEST = dict(mode="ipf", correction=0.0, islands=4, init="independent", jitter_lr=0.3, ess_threshold=0.75)
# qsr's alpha (relative to the peak rate) is the library's default 0.25; the screen at 4,096 ran at commit b291bf3,
# where it was absolute, 0.2 at the peak rate 0.8: the same schedule.
OUTER = {
  "local sgd H=8": dict(sync="every", sync_every=8, temperature=0.0),
  "qsr": dict(sync="qsr", sync_every=4, temperature=0.0),
  "qsr + filter (ess_target=0.5)": dict(sync="qsr", sync_every=4, sync_temperature=10.0, ess_target=0.5),
  "qsr + outer nesterov 0.7 x 0.9": dict(sync="qsr", sync_every=4, temperature=0.0, outer_lr=0.7, outer_momentum=0.9),
  "swap (half)": dict(sync="swap", sync_swap_fraction=0.5, temperature=0.0),
  # PAPA's per-member regularisation on the best arm: slot i smooths by 0.2 i / 7 and mixes with concentration
  # 0.2 i / 7 (slot 0 plain)
  "qsr + papa (label smoothing and mixup spread 0.2)": dict(
    sync="qsr", sync_every=4, temperature=0.0, label_smoothing_spread=0.2, mixup_spread=0.2
  ),
}
METHODS = {
  "ddp": dict(mode="ddp", num_particles=1),
  "deep ensemble": dict(mode="ensemble", num_particles=8),
  "ipf (defaults)": dict(mode="ipf"),
  "ipf digits' most diverse": DIGITS_BEST,
  # the algorithm's levers, one at a time and combined
  "ipf ess_target=0.5": dict(mode="ipf", ess_target=0.5),
  "ipf temperature=1": dict(mode="ipf", temperature=1.0),
  "ipf correction=1": dict(mode="ipf", correction=1.0),
  "ipf correction=1 + ess_target=0.5": dict(mode="ipf", correction=1.0, ess_target=0.5),
  "ipf correction=0.9 + ess_target=0.5": dict(mode="ipf", correction=0.9, ess_target=0.5),
  "ipf lr for the particle's batch (reference_batch_size=2048)": dict(mode="ipf", reference_batch_size=2048),
  # the seed's framing at batch 1,024 (P x compute: each of 8 models on 128 examples a step, at DDP's learning
  # rate for 128), for the population ipf is measured against there
  "deep ensemble lr for the member's batch (reference_batch_size=2048)": dict(
    mode="ensemble", num_particles=8, reference_batch_size=2048
  ),
  # diagnostics: tau = 0 keeps the weights uniform (no resampling) and lambda = 1 gives every particle the
  # mean gradient, so the particles stay one model: DDP whose BatchNorm normalises over each particle's 16
  # examples ("ghost" batches) instead of SyncBN's 128
  "ddp with BatchNorm per particle (ipf temperature=0 + correction=1)": dict(
    mode="ipf", temperature=0.0, correction=1.0
  ),
  "ipf correction=1 + ess_target=0.5 + weigh_on=common": dict(
    mode="ipf", correction=1.0, ess_target=0.5, weigh_on="common"
  ),
  "ipf correction=1 + ess_target=0.9": dict(mode="ipf", correction=1.0, ess_target=0.9),
  "ipf elastic_pull=0.1": dict(mode="ipf", elastic_pull=0.1),
  "ipf weigh_on=common": dict(mode="ipf", weigh_on="common"),
  "ipf ess_threshold=0.1": dict(mode="ipf", ess_threshold=0.1),
  "ipf jitter_lr=0.3": dict(mode="ipf", jitter_lr=0.3),
  "ipf islands=4 (ess_threshold=0.9)": dict(mode="ipf", islands=4, ess_threshold=0.9),
  # the outer loop (DESIGN.md §3b): plain local steps, the filter and the weighted average at syncs; the fused
  # model (the anchor) with its BatchNorm statistics re-estimated on 4 train batches, as SWAP does
  **{name: dict(mode="ipf", fused_bn_batches=4, **fields) for name, fields in OUTER.items()},
  # the control for the outer optimizer (Lookahead): the same schedule and outer Nesterov on one DDP model
  "ddp + qsr + outer nesterov 0.7 x 0.9 (lookahead)": dict(
    mode="ddp", num_particles=1, fused_bn_batches=4, **OUTER["qsr + outer nesterov 0.7 x 0.9"]
  ),
}
# The per-step arms name the filter they measured ("ipf (defaults)": the per-step filter's defaults, the library's
# before sync="auto" made a population's default the outer loop): sync="step" unless an arm sets its own.
for _fields in METHODS.values():
  if _fields.get("mode") == "ipf":
    _fields.setdefault("sync", "step")
COLUMNS = [
  ("ens_acc", 100, ".2f"),
  ("single_acc", 100, ".2f"),
  ("ens_nll", 1, ".3f"),
  ("single_nll", 1, ".3f"),
  ("ens_ece", 1, ".3f"),
  ("ens_brier", 1, ".3f"),
  ("shift_ens_acc", 100, ".1f"),
  ("shift_ens_ece", 1, ".3f"),
  ("ood_digits", 1, ".3f"),
  ("ood_photos", 1, ".3f"),
  ("disagreement", 1, ".3f"),
  ("resample_rate", 1, ".2f"),
  ("loss_std", 1, ".3f"),
]


TRAIN_SIZE = 60_000


def steps_per_epoch(batch: int, train_size: int = TRAIN_SIZE) -> int:
  return train_size // batch


def run_steps(args, train_size: int = TRAIN_SIZE) -> int:
  """The steps of one run: ``--steps``, else ``--epochs`` of ``--batch`` (as ``config.read.train_steps`` rounds) over
  ``train_size`` examples."""
  return args.steps or round(args.epochs * steps_per_epoch(args.batch, train_size))


def reference_rate(config) -> None:
  """The grid's ×1 for the CNN, which every table's ``lr ×`` multiplies: defaults.py's rate, 0.1 per 256
  examples scaled linearly with the batch (configs/fashion_mnist.py's own, 0.8 at any batch, is ×16 at 128,
  ×2 at 1,024 and ×0.5 at 4,096)."""
  config.base_lr, config.lr_scaling, config.reference_batch_size = 0.1, "linear", 256


def run_one(
  args, method: str, seed: int, workdir: str, overrides: dict | None = None, data=None, lr_scale: float = 1.0
) -> dict:
  """One (method, seed) run as ``configs/fashion_mnist.py`` (``--vit``: ``fashion_mnist_vit.py`` with the small
  ViT) with ``METHODS[method]`` (or ``overrides``) and its ``base_lr`` times ``lr_scale``; on ``data`` (e.g. an
  ``ArrayDataset``) instead of Fashion-MNIST when given, without the shifted and OOD sets (they are the built-in
  data's: ``None``)."""
  config = (fashion_mnist_vit if args.vit else fashion_mnist).get_config()
  config.data_dir, config.seed = args.data_dir, seed
  config.global_batch_size, config.num_epochs = args.batch, float(args.epochs)
  config.checkpoint_every_steps, config.log_every_steps = -1, 100
  config.eval_shifts, config.shift_examples, config.ood_dataset = "all", args.shift_examples, "digits,photos"
  if data is not None:
    config.eval_shifts, config.ood_dataset = "", ""
  if args.cnn_features:
    config.cnn_features = tuple(int(f) for f in args.cnn_features.split(","))
  if args.steps:
    config.num_epochs, config.num_train_steps = 0.0, args.steps
  if not args.vit:
    reference_rate(config)
  for k, v in (METHODS[method] if overrides is None else overrides).items():
    config[k] = v
  config.base_lr *= lr_scale  # --lr_scales: the same grid for every method
  train_size = TRAIN_SIZE if data is None else data.train_size
  steps = run_steps(args, train_size)
  if args.eval_every_epochs:
    config.eval_every_steps = max(1, int(args.eval_every_epochs * steps_per_epoch(args.batch, train_size)))
  t = time.perf_counter()
  task = small_vit(args.vit, config) if args.vit else None
  r = trainer.train_and_evaluate(config, workdir, task=task, data=data)
  seconds = time.perf_counter() - t
  scalars = report.read_scalars(workdir)
  single = (
    {m: float(np.nanmean(r["particles"][m])) for m in ("accuracy", "nll")} if config.mode == "ensemble" else r["fused"]
  )
  shifted = r.get("shifts", {}).values()
  ood = {k: float(v["ensemble"]["auroc_max_prob"]) for k, v in r.get("ood_sets", {}).items()}
  resamples = scalars.get("train/resamples", (None, [0.0]))[1]
  loss_steps, loss = scalars["train/loss"]
  tail = np.asarray(loss)[np.asarray(loss_steps) > 0.6 * steps]
  curve_steps, curve = scalars.get("eval/ensemble/accuracy", ([], []))
  row = {
    "method": method,
    "lr_scale": lr_scale,
    "model": model_name(args),
    "commit": commit(),
    "seed": seed,
    "steps": steps,
    "batch": args.batch,
    "epochs": args.epochs,
    "seconds": seconds,
    "ens_acc": r["ensemble"]["accuracy"],
    "single_acc": single["accuracy"],
    "ens_nll": r["ensemble"]["nll"],
    "single_nll": single["nll"],
    "ens_ece": r["ensemble"]["ece"],
    "ens_brier": r["ensemble"]["brier"],
    "shift_ens_acc": float(np.mean([s["ensemble"]["accuracy"] for s in shifted])) if shifted else None,
    "shift_ens_ece": float(np.mean([s["ensemble"]["ece"] for s in shifted])) if shifted else None,
    "ood_digits": ood.get("digits"),
    "ood_photos": ood.get("photos"),
    "disagreement": float(r.get("diversity", {}).get("disagreement", 0.0)),
    "particles_acc": [float(a) for a in np.atleast_1d(r["particles"]["accuracy"])],
    "particles_nll": [float(a) for a in np.atleast_1d(r["particles"]["nll"])],
    "resample_rate": float(resamples[-1]) / steps,
    "loss_std": float(np.std(tail)),
    "curve": [[int(s), float(a)] for s, a in zip(curve_steps, curve) if int(s) < steps]
    + [[steps, r["ensemble"]["accuracy"]]],
  }
  return json.loads(json.dumps(row, default=float))  # numpy and jax scalars as floats


def small_vit(spec: str, config) -> Task:
  """``--vit W,D,H,P``: the zoo's ViT task for ``config`` (its dropout, stochastic depth and head) with width W,
  depth D, H heads, an MLP of 4W and P x P patches."""
  width, depth, heads, patch = (int(x) for x in spec.split(","))
  task = builder.zoo_task(config, 10)
  model = task.model.clone(width=width, depth=depth, num_heads=heads, mlp_dim=4 * width, patch_size=patch)
  return dataclasses.replace(task, model=model)


def model_name(args) -> str:
  return f"vit {args.vit}" if args.vit else "cnn"


def reach_fraction(row: dict, target: float) -> float:
  """The first evaluated step at which ``row``'s ensemble accuracy reaches ``target``, over its steps
  (``nan``: never)."""
  for step, acc in row["curve"]:
    if acc >= target:
      return step / row["steps"]
  return float("nan")


def label(row: dict) -> str:
  """A row's method, with its learning-rate scale when it is not the config's."""
  scale = row.get("lr_scale", 1.0)
  return row["method"] if scale == 1.0 else f"{row['method']} (lr x{scale:g})"


def table(rows: list[dict]) -> str:
  """One line per method and learning rate; ``reach_ddp`` against the best DDP learning rate's mean."""
  ddp = {}
  for r in rows:
    if r["method"] == "ddp":
      ddp.setdefault(r.get("lr_scale", 1.0), []).append(r["ens_acc"])
  target = max((float(np.mean(v)) for v in ddp.values()), default=float("nan"))
  cols = COLUMNS + [("reach_ddp", 1, ".2f")]
  lines = ["| method | seeds | " + " | ".join(c for c, _, _ in cols) + " |", "|" + "---|" * (len(cols) + 2)]
  by_method = {}
  for r in rows:
    by_method.setdefault(label(r), []).append({**r, "reach_ddp": reach_fraction(r, target)})
  for method, rs in by_method.items():
    cells = []
    for c, scale, f in cols:
      v = np.asarray([r[c] for r in rs], float) * scale
      if not np.isfinite(v).any():
        cells.append("never")
      else:
        cells.append(f"{np.nanmean(v):{f}}" + (f" ± {np.nanstd(v):{f}}" if len(rs) > 1 else ""))
    lines.append(f"| {method} | {len(rs)} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def picture(rows: list[dict], path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4.5))
  by_method = {}
  for r in rows:
    by_method.setdefault(label(r), []).append(r)
  for method, rs in by_method.items():
    longest = max(rs, key=lambda r: len(r["curve"]))  # rows without per-epoch evaluations have one point
    xs = np.asarray([s for s, _ in longest["curve"]]) / steps_per_epoch(longest["batch"])
    ys = np.asarray([[a for _, a in r["curve"]] for r in rs if len(r["curve"]) == len(xs)]) * 100
    ax.errorbar(xs, ys.mean(0), yerr=ys.std(0), marker="o", capsize=3, label=f"{method[:40]} ({len(ys)} seeds)")
  ax.set_xlabel("epoch")
  ax.set_ylabel("test accuracy, % (ensemble; ddp: its model)")
  ax.set_title(f"Fashion-MNIST, global batch {rows[0]['batch']}, 8 CPU devices")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def start_study(parser: argparse.ArgumentParser, args, methods: dict) -> list[str]:
  """The ``--methods`` asked for (a parser error naming the unknown ones); the library's logging off and the
  compilation cache on."""
  joined = [m.strip() for m in args.methods.split(",") if m.strip()]
  unknown = [m for m in joined if m not in methods]
  if unknown:
    parser.error(f"unknown method(s) {unknown}; use some of: {', '.join(methods)}")
  logging.getLogger("ipf_jax").disabled = True
  jax.config.update("jax_compilation_cache_dir", os.path.join(tempfile.gettempdir(), "ipf_jax_jit_cache"))
  return joined


def previous_rows(args) -> list[dict]:
  """``--out``'s rows when ``--resume`` (the runs already measured), else none."""
  if not (args.resume and args.out and os.path.exists(args.out)):
    return []
  return [json.loads(line) for line in open(args.out) if line.strip()]


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--data_dir", default=os.path.expanduser("~/tensorflow_datasets"))
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--first_seed", type=int, default=0)
  parser.add_argument("--epochs", type=float, default=5.0)
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--steps", type=int, default=0, help="train this many steps instead (smoke runs)")
  parser.add_argument(
    "--methods",
    default="ddp,deep ensemble,ipf (defaults),ipf digits' most diverse",
    help="a comma list of: " + ", ".join(METHODS),
  )
  parser.add_argument(
    "--lr_scales", default="1", help="a comma list of factors on the config's base_lr, each run for every method"
  )
  parser.add_argument("--shift_examples", type=int, default=500)
  parser.add_argument("--eval_every_epochs", type=float, default=1.0, help="0: only at the end (no curve)")
  parser.add_argument("--cnn_features", default="", help="e.g. 4,8 (smoke runs; the tables use the config's)")
  parser.add_argument("--out", default="", help="append each run's row here (JSON lines)")
  parser.add_argument("--resume", action="store_true", help="skip the (method, seed) rows --out already has")
  parser.add_argument("--picture", default="", help="write the accuracy-vs-epoch picture here (PNG)")
  parser.add_argument("--vit", default="", help="width,depth,heads,patch: a small ViT instead of the CNN")
  args = parser.parse_args()
  sizes = args.vit.split(",") if args.vit else []
  if args.vit and (len(sizes) != 4 or not all(x.strip().isdigit() and int(x) > 0 for x in sizes)):
    parser.error(f"--vit {args.vit!r}: four positive integers, width,depth,heads,patch (e.g. 64,6,4,7)")
  if args.vit:
    width, _, heads, patch = (int(x) for x in sizes)
    if width % heads:
      parser.error(f"--vit {args.vit!r}: the width {width} must be a multiple of the heads {heads} (each a slice)")
    if 28 % patch:
      parser.error(f"--vit {args.vit!r}: the patch {patch} must divide Fashion-MNIST's 28 x 28 (1, 2, 4, 7, 14, 28)")
    args.vit = ",".join(str(int(x)) for x in sizes)  # one spelling, for --resume's match of earlier rows
  if args.vit and args.cnn_features:
    parser.error("--cnn_features sizes the CNN, and --vit trains a ViT instead: give one of them")
  joined = start_study(parser, args, METHODS)
  try:
    scales = [float(x) for x in args.lr_scales.split(",") if x.strip()]
  except ValueError:
    scales = []
  if not scales or min(scales) <= 0:
    parser.error(f"--lr_scales {args.lr_scales!r}: positive numbers, comma-separated (e.g. 0.125,0.25,0.5,1)")
  rows = [
    r
    for r in previous_rows(args)
    if (r["batch"], r["epochs"], r["steps"], r.get("model", "cnn"))
    == (args.batch, args.epochs, run_steps(args), model_name(args))
  ]
  done = {(r["method"], r.get("lr_scale", 1.0), r["seed"]) for r in rows}
  with tempfile.TemporaryDirectory() as tmp:
    for method, scale, seed in (
      (m, s, seed) for m in joined for s in scales for seed in range(args.first_seed, args.first_seed + args.seeds)
    ):
      if (method, scale, seed) in done:
        continue
      row = run_one(args, method, seed, os.path.join(tmp, f"{len(rows)}"), lr_scale=scale)
      rows.append(row)
      if args.out:
        with open(args.out, "a") as f:
          f.write(json.dumps(row) + "\n")
      print(
        f"done {label(row)} seed {seed}: ens_acc {100 * row['ens_acc']:.2f}% single {100 * row['single_acc']:.2f}% "
        f"in {row['seconds']:.0f} s",
        flush=True,
      )
  rows = [r for r in rows if r["method"] in joined]
  print(
    f"\nFashion-MNIST, {model_name(args)}, {args.epochs:g} epochs, global batch {args.batch}, 8 CPU devices, mean "
    "± std over seeds; "
    f"shift = the 25 corrupted sets (first {args.shift_examples} test images each); OOD AUROC by the "
    "ensemble's max probability; reach_ddp = first evaluated fraction of the run at which the ensemble "
    "reaches DDP's final accuracy\n"
  )
  print(table(rows))
  if args.picture:
    picture(rows, args.picture)
  print_summary({"benchmark": "fashion_mnist", "epochs": args.epochs, "batch": args.batch, "rows": rows})


if __name__ == "__main__":
  main()

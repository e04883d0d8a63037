"""Uncertainty on digits at equal compute (issue: Uncertainty): clean, corrupted, OOD, diversity.

  python -m studies.uncertainty_digits [--seeds 5] [--steps 300] [--methods ddp,ensemble,...] [--variants full]
                                          [--calibration_fraction 0.1] [--uniform]

Digits (scikit-learn), 8 fake CPU devices, the digits CNN, global batch 128 and
the same number of steps for every method (equal compute: every method trains
8 models on 16 examples each per step except ddp, one model on 128). Two data
variants: the full training split, and a harder one (20% of it with 20%
symmetric label noise). Each run is evaluated on the clean test set, on the
five digits corruptions at severities 1-5 (``config.eval_shifts=all``) and
against the photo patches as OOD (``config.ood_dataset=photos``). Reports mean
± std over seeds: accuracy, NLL, ECE, Brier of the weighted ensemble and of
the single model (ddp's model, ipf's fused model, the ensemble's mean member),
the ensemble's accuracy and ECE under the corruptions (mean over all 25 sets),
OOD AUROC by the ensemble's maximum probability, diversity at the end
(disagreement, pairwise KL) and resamplings per run. Every method starts from
``jitter_lr=0`` (the digits config before ``jitter_lr=0.3`` became its default,
which "ipf jitter_lr=0.3 (the digits default)" measures). With ``--calibration_fraction`` every run holds
that fraction of the train split out (clean labels) and the table adds the ensemble's temperature fitted on
it and its ECE at that temperature, clean and under the corruptions. ``--uniform`` adds the ensemble with equal
weights over the particles (clean, under the corruptions, OOD). ``SUMMARY`` has each row's means and,
under ``per_seed``, every seed's value (for paired comparisons). A benchmark, not a test.
"""

from __future__ import annotations

import logging
import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import base_overrides, print_summary, study_parser  # noqa: E402
from configs import digits  # noqa: E402
from ipf_jax.reporting import report  # noqa: E402
from ipf_jax.runtime import trainer

METHODS = {
  "ddp": dict(mode="ddp", num_particles=1),
  "deep ensemble": dict(mode="ensemble", num_particles=8),
  "ipf (jitter_lr=0)": dict(mode="ipf"),
  "ipf ess_target=0.5": dict(mode="ipf", ess_target=0.5),
  "ipf weigh_on=common": dict(mode="ipf", weigh_on="common"),
  "ipf jitter_lr=0.1": dict(mode="ipf", jitter_lr=0.1),
  "ipf jitter_lr=0.3 (the digits default)": dict(mode="ipf", jitter_lr=0.3),
  "ipf jitter_lr=0.6": dict(mode="ipf", jitter_lr=0.6),
  "ipf jitter_lr=1": dict(mode="ipf", jitter_lr=1.0),
  "ipf common + ess_target=0.5": dict(mode="ipf", weigh_on="common", ess_target=0.5),
  "ipf correction=0": dict(mode="ipf", correction=0.0),
  "ipf correction=0 + ess_target=0.5": dict(mode="ipf", correction=0.0, ess_target=0.5),
  "ipf correction=0 + islands=2": dict(mode="ipf", correction=0.0, islands=2),
  "ipf correction=0 + islands=4 (ess_threshold=0.9)": dict(mode="ipf", correction=0.0, islands=4, ess_threshold=0.9),
  "ipf correction=0 + islands=2 + jitter_lr=0.1": dict(mode="ipf", correction=0.0, islands=2, jitter_lr=0.1),
  "ipf correction=0 + islands=2 + jitter_lr=0.3": dict(mode="ipf", correction=0.0, islands=2, jitter_lr=0.3),
  "ipf correction=0 + jitter_lr=0.3": dict(mode="ipf", correction=0.0, jitter_lr=0.3),
  "ipf correction=0 + islands=2 + init=independent": dict(mode="ipf", correction=0.0, islands=2, init="independent"),
  "ipf correction=0 + islands=4 + init=independent (ess_threshold=0.9)": dict(
    mode="ipf", correction=0.0, islands=4, init="independent", ess_threshold=0.9
  ),
  **{
    f"ipf correction=0 + islands=4 + init=independent + jitter_lr=0.3 (ess_threshold={t})": dict(
      mode="ipf", correction=0.0, islands=4, init="independent", ess_threshold=t, jitter_lr=0.3
    )
    for t in (0.9, 0.75, 0.6, 0.55)
  },
  "seed recipe (rho=0; lr sqrt(world P))": dict(mode="ipf", forgetting=0.0, lr_scaling="seed"),
}
VARIANTS = {"full": dict(), "harder (20% + 20% noise)": dict(train_fraction=0.2, label_noise=0.2)}
COLUMNS = [
  ("ens_acc", 100, ".2f"),
  ("single_acc", 100, ".2f"),
  ("ens_nll", 1, ".3f"),
  ("single_nll", 1, ".3f"),
  ("ens_ece", 1, ".3f"),
  ("ens_brier", 1, ".3f"),
  ("shift_ens_acc", 100, ".1f"),
  ("shift_ens_ece", 1, ".3f"),
  ("ood_auroc", 1, ".3f"),
  ("disagreement", 1, ".3f"),
  ("pairwise_kl", 1, ".3f"),
  ("resamples", 1, ".0f"),
]
# With --calibration_fraction: the ensemble at the temperature fitted on the held-out part (clean labels)
SCALED_COLUMNS = [("T", 1, ".2f"), ("ens_ece_at_T", 1, ".3f"), ("shift_ens_ece_at_T", 1, ".3f")]
# With --uniform: the same ensemble with equal weights over the particles (the trainer's "ensemble (uniform)" row)
UNIFORM_COLUMNS = [
  ("uni_acc", 100, ".2f"),
  ("uni_nll", 1, ".3f"),
  ("uni_ece", 1, ".3f"),
  ("shift_uni_ece", 1, ".3f"),
  ("ood_auroc_uni", 1, ".3f"),
]


def run_one(method, variant, seed, steps, workdir, base=None):
  config = digits.get_config()
  config.sync = "step"  # the per-step filter these rows measured (a method may set the outer loop)
  config.seed, config.num_train_steps, config.log_every_steps = seed, steps, steps
  config.checkpoint_every_steps, config.num_cpu_devices = -1, 0
  config.eval_shifts, config.ood_dataset = "all", "photos"
  config.jitter_lr = 0.0  # every method from the digits config as it was before jitter_lr=0.3, so all rows reproduce
  for k, v in {**(base or {}), **METHODS[method], **VARIANTS[variant]}.items():
    config[k] = v
  r = trainer.train_and_evaluate(config, workdir)
  if config.mode == "ensemble":  # its single model: the mean member
    single = {m: float(np.nanmean(r["particles"][m])) for m in ("accuracy", "nll")}
  else:
    single = r["fused"]
  shifted = r["shifts"].values()
  resamples = report.read_scalars(workdir).get("train/resamples", (None, [0.0]))[1]
  return {
    "ens_acc": r["ensemble"]["accuracy"],
    "single_acc": single["accuracy"],
    "ens_nll": r["ensemble"]["nll"],
    "single_nll": single["nll"],
    "ens_ece": r["ensemble"]["ece"],
    "ens_brier": r["ensemble"]["brier"],
    "shift_ens_acc": float(np.mean([s["ensemble"]["accuracy"] for s in shifted])),
    "shift_ens_ece": float(np.mean([s["ensemble"]["ece"] for s in shifted])),
    "ood_auroc": float(r["ood"]["ensemble"]["auroc_max_prob"]),
    "disagreement": r["diversity"]["disagreement"],
    "pairwise_kl": r["diversity"]["pairwise_kl"],
    "resamples": float(resamples[-1]),
    "uni_acc": r["ensemble_uniform"]["accuracy"],
    "uni_nll": r["ensemble_uniform"]["nll"],
    "uni_ece": r["ensemble_uniform"]["ece"],
    "shift_uni_ece": float(np.mean([s["ensemble_uniform"]["ece"] for s in shifted])),
    "ood_auroc_uni": float(r["ood"]["ensemble_uniform"]["auroc_max_prob"]),
    **(
      {
        "T": r["temperature_scaled"]["ensemble"]["temperature"],
        "ens_ece_at_T": r["temperature_scaled"]["ensemble"]["ece"],
        "shift_ens_ece_at_T": float(np.mean([s["temperature_scaled"]["ensemble"]["ece"] for s in shifted])),
      }
      if "temperature_scaled" in r
      else {}
    ),
  }


def main():
  parser = study_parser(__doc__, seeds=5, methods=tuple(METHODS))
  parser.add_argument(
    "--variants", default=",".join(VARIANTS), help="a comma list of: " + ", ".join(VARIANTS).replace("%", "%%")
  )  # argparse formats help
  scaled_columns = ", ".join(c for c, _, _ in SCALED_COLUMNS)
  parser.add_argument(
    "--calibration_fraction",
    type=float,
    default=0.0,
    help="hold out this fraction of the train split (before the harder variant's subset and "
    f"label noise) to fit a temperature on; adds the columns {scaled_columns}",
  )
  parser.add_argument(
    "--uniform",
    action="store_true",
    help="add the columns " + ", ".join(c for c, _, _ in UNIFORM_COLUMNS) + ": the ensemble with equal weights",
  )
  args = parser.parse_args()
  base = {**base_overrides(args), "calibration_fraction": args.calibration_fraction}
  columns = COLUMNS + (SCALED_COLUMNS if args.calibration_fraction else []) + (UNIFORM_COLUMNS if args.uniform else [])
  logging.getLogger("ipf_jax").disabled = True
  jax.config.update("jax_compilation_cache_dir", os.path.join(tempfile.gettempdir(), "ipf_jax_jit_cache"))
  table, per_seed = {}, {}
  with tempfile.TemporaryDirectory() as tmp:
    for variant in args.variants.split(","):
      for method in args.methods.split(","):
        runs = [
          run_one(method, variant, seed, args.steps, os.path.join(tmp, f"{variant}-{method}-{seed}"), base)
          for seed in range(args.seeds)
        ]
        per_seed[(variant, method)] = seeds = {k: [float(r[k]) for r in runs] for k in runs[0]}
        table[(variant, method)] = {k: (float(np.mean(v)), float(np.std(v))) for k, v in seeds.items()}
        print(f"done {variant} / {method}", flush=True)
  print(
    f"\n{args.seeds} seeds, {args.steps} steps, global batch 128, mean ± std; shift = mean over the 25 "
    "corrupted test sets; OOD = photo patches, AUROC by the ensemble's max probability\n"
  )
  print("| data | method | " + " | ".join(c for c, _, _ in columns) + " |")
  print("|" + "---|" * (len(columns) + 2))
  for (variant, method), row in table.items():
    print(
      f"| {variant} | {method} | "
      + " | ".join(f"{scale * row[c][0]:{f}} ± {scale * row[c][1]:{f}}" for c, scale, f in columns)
      + " |"
    )
  print_summary(
    {
      "benchmark": "uncertainty_digits",
      "seeds": args.seeds,
      "steps": args.steps,
      "calibration_fraction": args.calibration_fraction,
      "results": {f"{v} / {m}": {k: r[k][0] for k in r} for (v, m), r in table.items()},
      "per_seed": {f"{v} / {m}": r for (v, m), r in per_seed.items()},
    }
  )


if __name__ == "__main__":
  main()

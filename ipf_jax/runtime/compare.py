"""``python -m ipf_jax.compare``: the modes at equal compute, one table, one picture.

  python -m ipf_jax.compare --config configs/digits.py                      # ddp, ensemble, ipf
  python -m ipf_jax.compare --config configs/fashion_mnist.py --modes ddp,ensemble,ipf --workdir runs/compare
  python -m ipf_jax.compare --config configs/digits.py --modes ddp,ipf:qsr --config.num_train_steps=200

Each mode trains in its own sub-folder of --workdir (``ddp``, ``ensemble``, ``ipf``, ``ipf_qsr``) with the
same config, global batch and steps: ``ddp`` with one model, the others with ``num_particles``. ``MODE:SYNC``
also sets ``sync`` (the outer loop, README "The fields that matter"); without it ``ddp`` and ``ensemble`` train with
``sync=step`` and ``ipf`` with the config's. A run is resumable: rerun the same command and each mode goes on
from its newest checkpoint; a finished mode is only evaluated. The config's ``--config.FIELD=VALUE`` overrides
apply to every mode. Then it prints one table (accuracy of the ensemble and of one model, NLL, ECE, the shifted
sets' and the OOD sets' numbers when the config evaluates them, disagreement) and writes --workdir/compare.png
(test accuracy against steps; reliability diagrams) and compare.json. Without --workdir: runs/<config>_compare.
"seconds" is what this command spent on a mode (a resumed or finished mode shows only its remainder). One
process (for multi-host runs, train each mode with train.py).

Exit codes as train.py's (0 finished; 1 error; 2 bad command line; 75, 130, 143 stopped with a checkpoint saved:
rerun the same command). ``--dry_run`` checks every mode's config, devices, data and sub-folder and says what
each would do, writing nothing.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time

import numpy as np
from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from ipf_jax import files
from ipf_jax.config import builder as build_lib
from ipf_jax.config import sync as sync_lib
from ipf_jax.config import validation
from ipf_jax.reporting import report, tables
from ipf_jax.runtime import cli, preemption, trainer

FLAGS = flags.FLAGS
MODES = ("ddp", "ensemble", "ipf")
flags.DEFINE_string(
  "modes",
  ",".join(MODES),
  "Comma list of MODE or MODE:SYNC (ddp, ensemble, ipf; sync: step, every, qsr, swap), trained at equal compute.",
)
# The evaluations along the run that the accuracy-against-steps picture draws, when the config asks for none.
CURVE_POINTS = 5


def parse_modes(text: str) -> list[tuple[str, str | None]]:
  """``"ddp,ipf:qsr"`` -> ``[("ddp", None), ("ipf", "qsr")]``; one error naming the entry that is not a mode."""
  entries = []
  for entry in (e.strip() for e in text.split(",")):
    mode, _, sync = entry.partition(":")
    if mode not in MODES:
      raise validation.ConfigError("mode", f"--modes {text!r}: {entry!r} is not one of {', '.join(MODES)}")
    entries.append((mode, sync or None))
  if len(set(entries)) != len(entries) or not entries:
    raise validation.ConfigError("mode", f"--modes {text!r}: name each mode once")
  return entries


def name_of(mode: str, sync: str | None) -> str:
  return mode + (f"_{sync}" if sync else "")


def mode_config(config, mode: str, sync: str | None):
  """The config of one mode: equal compute (the same global batch and steps), one model for DDP."""
  c = config.copy_and_resolve_references()
  c.mode = mode
  if mode == "ddp":
    c.num_particles = 1
  c.sync = sync or (config.sync if mode == "ipf" else "step")
  if mode == "ddp":  # the population's own fields do not apply to one model
    c.islands, c.particle_axis_size = 1, 0
  if "tensorboard" not in c.trackers.split(","):  # the picture's curves are read from the event files
    c.trackers = "tensorboard," + c.trackers
  if not c.eval_every_steps and c.num_train_steps > 0:
    c.eval_every_steps = max(1, c.num_train_steps // CURVE_POINTS)  # the picture's curve
  return c


def fused_is_the_model(config) -> bool:
  """Whether a mode's one model is its fused one: ipf's, or the outer loop's anchor (Lookahead's in ddp)."""
  return config.mode == "ipf" or sync_lib.resolve(config) != "step"


def summary_row(name: str, config, results: dict) -> dict:
  """The table's numbers for one mode: the ensemble's and one model's (DDP: its model; an ensemble of
  independent inits: its members' mean, as its fused model means nothing; ipf: the fused model)."""
  ens = results["ensemble"]
  if fused_is_the_model(config) and "fused" in results:
    one, what = float(results["fused"]["accuracy"]), "fused"
  else:
    one, what = float(np.mean(results["particles"]["accuracy"])), "member" if config.num_particles > 1 else "model"
  row = dict(
    name=name, particles=config.num_particles, accuracy=float(ens["accuracy"]), one_model=one, one_model_is=what,
    nll=float(ens["nll"]), ece=float(ens["ece"]),
    disagreement=float(results["diversity"]["disagreement"]) if config.num_particles > 1 else None,
  )  # fmt: skip
  shifts = results.get("shifts", {})
  if shifts:
    row["shift_accuracy"] = float(np.mean([r["ensemble"]["accuracy"] for r in shifts.values()]))
    row["shift_ece"] = float(np.mean([r["ensemble"]["ece"] for r in shifts.values()]))
  ood = results.get("ood_sets", {})
  if ood:
    row["ood_auroc"] = float(np.mean([sets["ensemble"]["auroc_max_prob"] for sets in ood.values()]))
  return row


COLUMNS = (
  ("mode", "name", "{}"),
  ("P", "particles", "{}"),
  ("ensemble acc", "accuracy", "{:.2%}"),
  ("one model acc", "one_model", "{:.2%}"),
  ("(which)", "one_model_is", "{}"),
  ("NLL", "nll", "{:.4f}"),
  ("ECE", "ece", "{:.4f}"),
  ("shift acc", "shift_accuracy", "{:.2%}"),
  ("shift ECE", "shift_ece", "{:.4f}"),
  ("OOD AUROC", "ood_auroc", "{:.4f}"),
  ("disagreement", "disagreement", "{:.4f}"),
  ("seconds", "seconds", "{:.0f}"),
)


def format_table(rows: list[dict]) -> str:
  """One line per mode; a column only when some mode has its number."""
  shown = [c for c in COLUMNS if any(r.get(c[1]) is not None for r in rows)]
  cells = [[title for title, _, _ in shown]]
  cells += [[fmt.format(r[key]) if r.get(key) is not None else "-" for _, key, fmt in shown] for r in rows]
  lines = tables.aligned(cells)
  lines.insert(1, "-" * len(lines[0]))
  return "\n".join(lines)


def plot(runs: list[tuple[str, str, dict, bool]], path: str) -> None:
  """Test accuracy against steps (the ensemble solid, one model dashed) and each mode's ensemble reliability."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (curve, rel) = plt.subplots(1, 2, figsize=(11, 4.2))
  for k, (name, workdir, results, fused) in enumerate(runs):
    scalars = report.read_scalars(workdir)
    for tag, style in (("eval/ensemble/accuracy", "-"), ("eval/fused/accuracy", "--")):
      if tag in scalars and (style == "-" or fused):
        steps, values = scalars[tag]
        what = " fused" if style == "--" else "" if len(results["weights"]) == 1 else " ensemble"
        curve.plot(steps, 100 * np.asarray(values), style, color=f"C{k}", marker=".", label=name + what)
    r = np.asarray(results["ensemble"]["reliability"])  # [bins, 3]: count, mean confidence, accuracy
    filled = r[:, 0] > 0
    rel.plot(
      r[filled, 1], r[filled, 2], "-o", color=f"C{k}", ms=3, label=f"{name} (ECE {results['ensemble']['ece']:.3f})"
    )
  curve.set(xlabel="step", ylabel="test accuracy (%)", title="Test accuracy against steps")
  rel.plot([0, 1], [0, 1], "k:", lw=0.8)
  rel.set(xlabel="confidence", ylabel="accuracy", xlim=(0, 1), ylim=(0, 1), title="Reliability (ensemble)")
  for ax in (curve, rel):
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def compare(config, workdir: str, modes: list[tuple[str, str | None]], dry_run: bool = False) -> list[dict]:
  """Trains (or resumes, or only evaluates) each mode in ``workdir/<mode>``; writes the table, compare.json and
  compare.png; returns the rows. Every mode's config is checked before the first trains; ``dry_run``: only
  that, and what each would do."""
  import jax

  configs = [(name_of(m, s), mode_config(config, m, s)) for m, s in modes]
  for _, c in configs:
    build_lib.mesh_for(c)  # every mode's config checked on the devices before the first trains
  if dry_run:  # what each mode would do (train, resume at step N, only evaluate); nothing compiled or written
    with tempfile.TemporaryDirectory() as empty:  # a --workdir not made yet: checked as a new one would be
      where = workdir if os.path.isdir(workdir) else empty
      for name, c in configs:
        print(f"{name}: {trainer.check_run(c, os.path.join(where, name)).replace(where, workdir)}")
    return []
  runs, rows = [], []
  for k, (name, c) in enumerate(configs):
    sub = os.path.join(workdir, name)
    print(f"== {name} ({k + 1}/{len(configs)}): {c.num_particles} model(s), {sub}", flush=True)
    start = time.perf_counter()
    results = trainer.train_and_evaluate(c, sub)
    runs.append((name, sub, results, fused_is_the_model(c)))
    rows.append(dict(summary_row(name, c, results), seconds=round(time.perf_counter() - start, 1)))
  table = format_table(rows)
  if jax.process_index() == 0:
    files.write_atomic(os.path.join(workdir, "compare.json"), json.dumps(rows, indent=2))
    plot(runs, os.path.join(workdir, "compare.png"))
  print(f"\nequal compute: global batch {config.global_batch_size}, the same steps; {workdir}/compare.png\n{table}")
  return rows


def main(argv) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  absl_logging.set_verbosity(absl_logging.WARNING)
  for name in ("absl", "asyncio"):
    logging.getLogger(name).setLevel(logging.CRITICAL)
  workdir = FLAGS.workdir or os.path.join(
    "runs", os.path.splitext(os.path.basename(config_flags.get_config_filename(FLAGS["config"])))[0] + "_compare"
  )
  try:
    if not FLAGS.dry_run:
      os.makedirs(workdir, exist_ok=True)
    compare(FLAGS.config, workdir, parse_modes(FLAGS.modes), dry_run=FLAGS.dry_run)
  except cli.ERRORS as e:
    print(f"error: {e}", file=sys.stderr)
    return preemption.EXIT_ERROR
  except preemption.RunStopped as e:
    return e.exit_code
  except OSError as e:
    print(f"error: --workdir {workdir}: {e.strerror}", file=sys.stderr)
    return preemption.EXIT_ERROR
  except KeyboardInterrupt:
    print("interrupted: stopped at once; nothing saved since the newest checkpoint", file=sys.stderr)
    return preemption.EXIT_SIGINT
  return 0


def run(argv=None) -> None:
  argv = argv or sys.argv
  if any(a in ("--help", "-h", "--helpshort", "-?") for a in argv[1:]):
    print(__doc__.strip() + "\n")
    helps = {name: FLAGS[name].help for name in ("config", "modes", "dry_run")}
    helps["workdir"] = "Folder of the comparison: one sub-folder per mode; default runs/<config file's name>_compare."
    for name, text in helps.items():
      print(f"  --{name}: {text}")
    sys.exit(0)
  app.run(lambda a: sys.exit(main(a)), argv=argv, flags_parser=cli.parse_flags)

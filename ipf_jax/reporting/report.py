"""Pictures of a run from its TensorBoard event files.

  python -m ipf_jax.reporting WORKDIR [--out WORKDIR/report]

Writes training_curves.png (per-particle loss; float16: the loss scale), weights.png (ESS and weights
over time, resampling events marked), genealogy.png (which slot descends from
which at each resampling) and eval.png (the task's metrics, e.g. accuracy, NLL
and ECE, of every particle, the ensembles and the fused model at the last
evaluation); from the final evaluation's eval_results.json (classification; a run that did not
finish: the newest eval_results.step<N>.json of --eval_only):
calibration.png (reliability diagrams, accuracy against coverage) and, when
the run evaluated shifted sets, shifts.png (accuracy and ECE per severity).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import struct

import numpy as np


def read_scalars(workdir: str) -> dict:
  """``{tag: (steps [n], values [n])}`` from every event file in ``workdir``, sorted by step.

  Files are read oldest first, so a resumed run's values replace those of the
  steps it repeats. A file whose last record was cut off (a killed run) is
  read up to that record.
  """
  if not os.path.isdir(workdir):
    raise FileNotFoundError(f"{workdir} does not exist; run train.py with --workdir {workdir} first")
  data = collections.defaultdict(dict)
  files = sorted(glob.glob(os.path.join(workdir, "events.out.tfevents.*")), key=_event_file_order)
  if not files:
    raise FileNotFoundError(f"no TensorBoard event files in {workdir}; run train.py with --workdir {workdir} first")
  for path in files:
    for event in _events(path):
      for v in event.summary.value:
        data[v.tag][event.step] = v.simple_value
  return {tag: (np.array(sorted(d)), np.array([d[s] for s in sorted(d)])) for tag, d in data.items()}


def _events(path: str):
  """The ``Event`` records of one TFRecord file, up to the first incomplete or corrupt one.

  (TensorFlow's ``summary_iterator`` raises on a truncated last record and is
  deprecated; the format is a length, its CRC, the data and its CRC.)
  """
  from tensorboardX.proto.event_pb2 import Event
  from tensorboardX.record_writer import masked_crc32c

  with open(path, "rb") as f:
    while True:
      header = f.read(12)
      if len(header) < 12 or struct.unpack("<I", header[8:])[0] != masked_crc32c(header[:8]):
        return
      (length,) = struct.unpack("<Q", header[:8])
      data, crc = f.read(length), f.read(4)
      if len(data) < length or len(crc) < 4 or struct.unpack("<I", crc)[0] != masked_crc32c(data):
        return
      yield Event.FromString(data)


def _event_file_order(path: str):
  """Event files are named ``events.out.tfevents.<unix time>.<host>...``: oldest first."""
  parts = os.path.basename(path).split(".")
  return (int(parts[3]) if len(parts) > 3 and parts[3].isdigit() else 0, path)


def _indexed(scalars: dict, prefix: str) -> dict:
  """``{i: (steps, values)}`` for tags ``prefix<i>``."""
  out = {}
  for tag, sv in scalars.items():
    m = re.fullmatch(re.escape(prefix) + r"(\d+)", tag)
    if m:
      out[int(m.group(1))] = sv
  return dict(sorted(out.items()))


def plot_training_curves(scalars, path, plt):
  fig, ax = plt.subplots(figsize=(8, 4.5))
  for i, (s, v) in _indexed(scalars, "particle/loss/").items():
    ax.plot(s, v, lw=0.8, alpha=0.7, label=f"particle {i}")
  if "train/loss" in scalars:
    ax.plot(*scalars["train/loss"], color="k", lw=1.5, label="weighted mean")
  ax.set(xlabel="step", ylabel="training loss", yscale="log", title="Per-particle training loss")
  ax.legend(fontsize=7, ncol=2)
  if "train/loss_scale" in scalars:  # float16 runs: the dynamic loss scale on a second axis
    scale = ax.twinx()
    scale.step(*scalars["train/loss_scale"], where="post", color="C3", lw=1, alpha=0.6)
    scale.set(ylabel="loss scale (float16)", yscale="log")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _resample_steps(scalars):
  if "resample/event" not in scalars:
    return np.array([])
  s, v = scalars["resample/event"]
  return s[v > 0]


def plot_weights(scalars, path, plt):
  fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
  weights = _indexed(scalars, "particle/weight/")
  if "train/ess" in scalars:
    ax1.plot(*scalars["train/ess"], color="C0")
    ax1.axhline(len(weights), color="gray", lw=0.5, ls=":")
  ax1.set(ylabel="ESS", title="Effective sample size and weights (dashed: resampling)")
  if weights:
    steps = next(iter(weights.values()))[0]
    stack = np.stack([np.interp(steps, s, v) for s, v in weights.values()])
    ax2.stackplot(steps, stack, labels=[f"{i}" for i in weights], alpha=0.8)
  ax2.set(xlabel="step", ylabel="weight", ylim=(0, 1))
  for s in _resample_steps(scalars):
    for ax in (ax1, ax2):
      ax.axvline(s, color="r", lw=0.4, ls="--", alpha=0.5)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot_genealogy(scalars, path, plt):
  ancestors = _indexed(scalars, "resample/ancestor/")
  fig, ax = plt.subplots(figsize=(8, 4.5))
  num = len(ancestors) or len(_indexed(scalars, "particle/weight/"))
  events = _resample_steps(scalars)
  ax.set(
    xlabel="resampling event",
    ylabel="slot",
    title="Particle genealogy: slot <- ancestor at each resampling",
    yticks=range(num),
  )
  for k, step in enumerate(events):
    for slot, (s, v) in ancestors.items():
      hit = np.nonzero(s == step)[0]
      if hit.size:
        a = int(v[hit[0]])
        ax.plot(
          [k, k + 1],
          [a, slot],
          color="C3" if a != slot else "C0",
          lw=1.2 if a != slot else 0.6,
          alpha=0.9 if a != slot else 0.4,
        )
  if not len(events):
    ax.text(0.5, 0.5, "no resampling in this run", transform=ax.transAxes, ha="center")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot_eval(scalars, path, plt):
  rows = ("ensemble", "ensemble_uniform", "fused", "fused_bn")
  models = sorted(
    {
      t.split("/")[1]
      for t in scalars
      if t.startswith("eval/") and (t.split("/")[1] in rows or re.fullmatch(r"particle_\d+", t.split("/")[1]))
    },
    key=lambda m: (not m.startswith("particle"), int(m.split("_")[1]) if m.startswith("particle_") else 0, m),
  )
  present = {t.split("/")[2] for t in scalars if t.startswith("eval/") and t.split("/")[1] in models}
  metrics = (
    [m for m in ("accuracy", "nll", "ece", "brier", "rmse") if m in present] or sorted(present)[:3] or ["accuracy"]
  )
  fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 4), squeeze=False)
  for ax, metric in zip(axes[0], metrics):
    vals = [scalars[f"eval/{m}/{metric}"][1][-1] if f"eval/{m}/{metric}" in scalars else np.nan for m in models]
    colors = ["C0" if m.startswith("particle") else "C3" for m in models]
    ax.bar(range(len(models)), vals, color=colors)
    ax.set_xticks(range(len(models)), [m.replace("particle_", "p") for m in models], rotation=60, fontsize=7)
    ax.set_title(metric)
    if metric == "accuracy" and np.isfinite(vals).any():
      lo = np.nanmin(vals)
      ax.set_ylim(max(0.0, lo - 0.05), min(1.0, np.nanmax(vals) + 0.01))
  fig.suptitle("Final evaluation: particles (blue), ensembles and fused model (red)")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def results_path(workdir: str) -> str | None:
  """The run's ``eval_results.json`` (its final evaluation) or, when it has none (a run that did not finish),
  the newest ``eval_results.step<N>.json`` that ``--eval_only`` wrote; ``None``: neither."""
  path = os.path.join(workdir, "eval_results.json")
  if os.path.exists(path):
    return path
  steps = [
    (int(m.group(1)), name)
    for name in os.listdir(workdir)
    if (m := re.fullmatch(r"eval_results\.step(\d+)\.json", name))
  ]
  return os.path.join(workdir, max(steps)[1]) if steps else None


def read_results(workdir: str) -> dict | None:
  """The evaluation ``results_path`` names, or ``None``."""
  path = results_path(workdir)
  if path is None:
    return None
  with open(path) as f:
    return json.load(f)


ROW_NAMES = {"ensemble": "ensemble (weighted)", "fused": "fused model"}


def plot_reliability(results, path, plt):
  """Reliability diagrams (accuracy against confidence per bin, bar width = bin) of the ensemble and the
  fused model, and their accuracy against coverage (selective prediction)."""
  rows = [k for k in ROW_NAMES if "reliability" in results.get(k, {})]
  fig, axes = plt.subplots(1, len(rows) + 1, figsize=(4 * (len(rows) + 1), 4), squeeze=False)
  for ax, key in zip(axes[0], rows):
    rel = np.asarray(results[key]["reliability"])  # [bins, 3]: count, mean confidence, accuracy
    edges = np.linspace(0, 1, len(rel) + 1)
    filled = rel[:, 0] > 0
    ax.bar(
      edges[:-1][filled],
      rel[filled, 2],
      width=1 / len(rel),
      align="edge",
      color="C0",
      edgecolor="k",
      lw=0.5,
      label="accuracy",
    )
    ax.bar(
      edges[:-1][filled],
      rel[filled, 1] - rel[filled, 2],
      bottom=rel[filled, 2],
      width=1 / len(rel),
      align="edge",
      color="C3",
      alpha=0.3,
      label="gap to confidence",
    )
    ax.plot([0, 1], [0, 1], "k:", lw=0.8)
    ax.set(
      xlabel="confidence",
      ylabel="accuracy",
      xlim=(0, 1),
      ylim=(0, 1),
      title=f"{ROW_NAMES[key]}: ECE {results[key]['ece']:.4f}",
    )
    ax.legend(fontsize=7, loc="upper left")
  ax = axes[0][-1]
  coverage = np.arange(1, 101) / 100.0
  for key in rows:
    ax.plot(
      coverage, results[key]["selective_accuracy"], label=f"{ROW_NAMES[key]} (area {results[key]['selective_auc']:.4f})"
    )
  ax.set(xlabel="coverage (most confident fraction kept)", ylabel="accuracy", title="Selective prediction")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot_shifts(results, path, plt):
  """Two metrics (accuracy and ECE, or the first two the task has) per corruption against its severity
  (ensemble: solid, fused model: dashed, the ensemble's ECE at the fitted temperature: dotted); sets without
  severities as points at 0."""
  from ipf_jax.data.shifts import family

  families = collections.defaultdict(dict)
  for name, r in results["shifts"].items():
    corruption, level = family(name)
    families[corruption][level] = r
  first = next(iter(results["shifts"].values()))
  scalars = [m for m, v in first.get("ensemble", {}).items() if np.ndim(v) == 0]
  shown = [m for m in ("accuracy", "ece") if m in scalars] or scalars[:2]
  scaled = "ensemble" in first.get("temperature_scaled", {})  # every set of a run has it, or none
  fig, axes = plt.subplots(1, len(shown), figsize=(5 * len(shown), 4), squeeze=False)
  for i, (corruption, levels) in enumerate(sorted(families.items())):
    xs = sorted(levels)
    for ax, metric in zip(axes[0], shown):
      for key, style in (("ensemble", "-"), ("fused", "--")):
        if key in levels[xs[0]]:
          ax.plot(
            xs,
            [levels[x][key][metric] for x in xs],
            style,
            marker="o",
            ms=3,
            color=f"C{i % 10}",
            label=corruption if key == "ensemble" else None,
          )
      if metric == "ece" and scaled:
        ax.plot(
          xs,
          [levels[x]["temperature_scaled"]["ensemble"]["ece"] for x in xs],
          ":",
          marker="x",
          ms=3,
          color=f"C{i % 10}",
        )
  for ax, metric in zip(axes[0], shown):
    ax.set(xlabel="severity (0: a set without severities)", ylabel=metric, title=f"{metric} under shift")
  axes[0][0].legend(fontsize=7)
  fig.suptitle(
    "solid: ensemble, dashed: fused model"
    + (", dotted: the ensemble at the temperature fitted on held-out data" if scaled else ""),
    fontsize=9,
  )
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


# The pictures: from the TensorBoard scalars, always; from the results file, when it has what each needs.
SCALAR_PICTURES = (
  ("training_curves.png", plot_training_curves),
  ("weights.png", plot_weights),
  ("genealogy.png", plot_genealogy),
  ("eval.png", plot_eval),
)
RESULT_PICTURES = (("calibration.png", plot_reliability, "ensemble"), ("shifts.png", plot_shifts, "shifts"))
PICTURES = tuple(p[0] for p in SCALAR_PICTURES + RESULT_PICTURES)


def write_report(workdir: str, out: str | None = None) -> list[str]:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  scalars = read_scalars(workdir)  # before creating anything: a wrong path creates nothing
  out = out or os.path.join(workdir, "report")
  os.makedirs(out, exist_ok=True)
  paths = []
  for name, fn in SCALAR_PICTURES:
    path = os.path.join(out, name)
    fn(scalars, path, plt)
    paths.append(path)
  results = read_results(workdir)
  for name, fn, needs in RESULT_PICTURES if results else ():
    if needs in results and (needs != "ensemble" or "reliability" in results["ensemble"]):
      path = os.path.join(out, name)
      fn(results, path, plt)
      paths.append(path)
  return paths


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("workdir")
  parser.add_argument("--out", default=None, help="output folder (default WORKDIR/report)")
  args = parser.parse_args(argv)
  try:
    paths = write_report(args.workdir, args.out)
  except FileNotFoundError as e:
    raise SystemExit(f"error: {e}") from None
  except OSError as e:
    raise SystemExit(
      f"error: cannot write the pictures to {args.out or os.path.join(args.workdir, 'report')} "
      f"({e.strerror or e}); choose another --out"
    ) from None
  for p in paths:
    print(p)
  out = os.path.dirname(paths[0])
  for name in sorted(set(PICTURES) - {os.path.basename(p) for p in paths}):
    if os.path.exists(os.path.join(out, name)):  # kept, not deleted: it is not this report's to judge
      print(f"note: {os.path.join(out, name)} is from an earlier report; this run's results have nothing for it")


if __name__ == "__main__":
  main()

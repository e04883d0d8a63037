"""The final evaluation as text: the table of particles, ensembles and fused model, and the lines under it."""

from __future__ import annotations

import numpy as np

from ipf_jax.evaluation.results import ROWS


# A population has collapsed when its members disagree on fewer test examples than a tenth of those the ensemble
# gets wrong: an ensemble gains only where members differ, and it errs where they agree, so at this ratio it
# can correct at most a tenth of its errors (a deep ensemble of the CNN on Fashion-MNIST disagrees on about half
# as many examples as it gets wrong; the per-step filter at batch 128, which reaches DDP's accuracy, on 0.05 of
# them). Relative, not absolute: on digits every model errs on under 1% of the examples.
COLLAPSE_RATIO = 0.1


def aligned(rows: list) -> list[str]:
  """Rows of cells as text lines: the first column left-aligned, the others right-aligned, two spaces apart."""
  widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
  return ["  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))) for r in rows]


def collapse_line(results: dict, outer: bool = False) -> str:
  """One line when the population has collapsed into copies (``COLLAPSE_RATIO``), else ``""``; its advice is the
  outer loop's (``outer``: ``sync_pull``) or the per-step filter's."""
  disagreement = results.get("diversity", {}).get("disagreement")
  accuracy = results.get("ensemble", {}).get("accuracy")
  if disagreement is None or accuracy is None or disagreement >= COLLAPSE_RATIO * max(1.0 - accuracy, 1e-9):
    return ""
  return (
    f"the population has collapsed into copies: its members disagree on {100 * disagreement:.2f}% of the test "
    f"examples, the ensemble errs on {100 * (1 - accuracy):.2f}%, so the ensemble is one model and its "
    "uncertainty one model's. To keep members apart: "
    + (
      "sync_pull=0.5 (each particle moves halfway to the average at a sync)"
      if outer
      else "sync='qsr' (the outer loop; the last local phase is never averaged away), a lower temperature"
    )
    + ", islands or init='independent' (README, \"The fields that matter\")"
  )


def format_extras(results: dict, columns: tuple, outer: bool = False) -> str:
  """Lines under the table: diversity, temperature scaling, shifts (mean over severities; accuracy and ECE,
  or the first two of the task's ``columns``; the ECE at the fitted temperature when there is one) and OOD."""
  lines = []
  if "diversity" in results and len(results["weights"]) > 1:
    d = results["diversity"]
    lines.append(
      f"diversity of the population: disagreement {d['disagreement']:.4f}, pairwise KL {d['pairwise_kl']:.4f}"
    )
    collapsed = collapse_line(results, outer)
    if collapsed:
      lines.append(collapsed)
  for key, t in results.get("temperature_scaled", {}).items():
    r = results[key]
    edge = " (the grid's edge: the best T may lie beyond)" if t["at_grid_edge"] else ""
    lines.append(
      f"temperature scaling, {dict((k, n) for n, k in ROWS)[key]}: T = {t['temperature']:.3g}{edge}; NLL "
      f"{r['nll']:.4f} -> {t['nll']:.4f}, ECE {r['ece']:.4f} -> {t['ece']:.4f}, Brier "
      f"{r['brier']:.4f} -> {t['brier']:.4f}"
    )
  shifts = results.get("shifts", {})
  if shifts:
    from ipf_jax.data.shifts import family

    families = {}
    for name, r in shifts.items():
      families.setdefault(family(name)[0], []).append(r)
    present = next(iter(shifts.values())).get("ensemble", {})
    shown = [c for c in columns if c[1] in ("accuracy", "ece") and c[1] in present] or [
      c for c in columns if c[1] in present
    ][:2]
    rows_shown = [key for key in ("ensemble", "fused") if key in next(iter(shifts.values()))]
    scaled = next(iter(shifts.values())).get("temperature_scaled", {})
    cells = []  # (heading, value of one set's results, format)
    for key in rows_shown:
      cells += [
        (f"{key} {title}", lambda r, key=key, metric=metric: r[key][metric], fmt) for title, metric, fmt in shown
      ]
      if key in scaled:
        cells.append((f"{key} ECE at T", lambda r, key=key: r["temperature_scaled"][key]["ece"], "{:.4f}"))
    rows = [("shift (mean over severities)",) + tuple(heading for heading, _, _ in cells)]
    for name, rs in families.items():
      rows.append((name,) + tuple(fmt.format(np.mean([get(r) for r in rs])) for _, get, fmt in cells))
    lines += aligned(rows)
  ood = results.get("ood_sets") or ({results.get("ood_dataset", "OOD set"): results["ood"]} if "ood" in results else {})
  for name, by_row in ood.items():
    for key, a in by_row.items():
      if key != "particles":
        lines.append(
          f"OOD AUROC ({name}), {dict((k, n) for n, k in ROWS)[key]}: "
          f"max prob {a['auroc_max_prob']:.4f}, entropy {a['auroc_entropy']:.4f}"
        )
  return "\n".join(lines)


def format_table(results: dict, columns: tuple, shared_init: bool = True) -> str:
  """One row per particle (with its weight), the two ensembles and the fused model(s)."""
  weights = results["weights"]
  rows = [("model", "weight") + tuple(title for title, _, _ in columns)]
  p = results["particles"]
  for i in range(len(weights)):
    rows.append((f"particle {i}", f"{weights[i]:.3f}") + tuple(fmt.format(p[key][i]) for _, key, fmt in columns))
  for name, key in ROWS:
    if key in results:
      rows.append((name, "") + tuple(fmt.format(results[key][k]) for _, k, fmt in columns))
  lines = aligned(rows)
  lines.insert(1, "-" * len(lines[0]))
  if not shared_init:
    lines.append("(independent inits: the fused model averages unrelated networks and is not meaningful)")
  return "\n".join(lines)

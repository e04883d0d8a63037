"""Evaluation: the eval step (every particle, both ensembles, the fused model), the loop over an eval set
(every example exactly once: padded last batch, masked) and the final table."""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from ipf_jax import correction
from ipf_jax import filter as pf
from ipf_jax import fusion
from ipf_jax import metrics
from ipf_jax import sharing
from ipf_jax.data import layout
from ipf_jax.data.errors import DataError
from ipf_jax.mesh import DATA, PARTICLE
from ipf_jax.particles import over_particles
from ipf_jax.state import ParticleState, state_specs
from ipf_jax.task import Task

ROWS = (("ensemble (weighted)", "ensemble"), ("ensemble (uniform)", "ensemble_uniform"), ("fused model", "fused"),
        ("fused model, BN re-estimated", "fused_bn"))
BRIEF = ("accuracy", "nll", "ece", "brier", "selective_auc", "reliability")  # what a shifted set keeps


def make_eval_step(task: Task, mesh: jax.sharding.Mesh, particle_loop: str = "vmap") -> Callable:
  """``eval_step(state, batch, fused_bn=None) -> sums`` for every particle, the ensembles and the fused model.

  ``batch`` is a dict of ``[N, ...]`` arrays with a ``mask`` (1 = real example), split over every
  device (``layout.EVAL_BATCH_SPEC``); the step gathers each device's part over ``"particle"``, so
  that every particle sees every example and no host has to read them all. Returns ``task.score``
  sums, replicated: ``particles`` with a leading ``[P]`` axis, ``ensemble`` (the mixture
  ``sum_i w_i predictive_i``), ``ensemble_uniform`` (equal weights over finite particles), ``fused``
  (``f(sum_i w_i theta_i)`` with ``sum_i w_i beta_i``) and, with ``fused_bn`` (replicated BatchNorm statistics from
  ``fusion.make_fused_bn_fn``), ``fused_bn``; plus ``weights`` ``[P]``.
  """

  def predict(params, shared, batch_stats, batch):
    outputs = task.apply({"params": sharing.merge(params, shared), "batch_stats": batch_stats}, batch, train=False)
    return task.predictive(outputs, batch)

  def local_eval(state: ParticleState, batch, fused_bn):
    mine = batch  # this device's part: the fused model (one model, replicated) is evaluated on it alone
    batch = jax.tree.map(lambda x: pf.gather_all(x, PARTICLE), batch)  # my data group's examples, every device
    mask = batch["mask"]
    shared = state.shared_params
    pred = over_particles(predict, particle_loop, (0, None, 0, None))(state.params, shared, state.batch_stats, batch)
    w = jnp.exp(state.log_weights)
    alive = (w > 0).astype(jnp.float32)
    per_particle = jax.vmap(task.score, in_axes=(0, None, None))(pred, batch, mask)
    ensemble = mixture(pred, w, PARTICLE)
    uniform = mixture(pred, alive / lax.psum(alive.sum(), PARTICLE), PARTICLE)
    params, stats = fusion.fused(state)
    sums = {"particles": jax.tree.map(lambda x: pf.gather_all(x, PARTICLE), per_particle),
            "ensemble": task.score(ensemble, batch, mask),
            "ensemble_uniform": task.score(uniform, batch, mask)}
    fused_sums = {"fused": task.score(predict(params, shared, stats, mine), mine, mine["mask"])}
    if fused_bn is not None:
      fused_sums["fused_bn"] = task.score(predict(params, shared, fused_bn, mine), mine, mine["mask"])
    if task.diversity is not None:
      sums["diversity"] = task.diversity(pred, alive, mask, lambda x: lax.psum(x, PARTICLE))
    return {**lax.psum(sums, DATA), **lax.psum(fused_sums, (PARTICLE, DATA)), "weights": pf.gather_all(w, PARTICLE)}

  sharded = jax.jit(jax.shard_map(local_eval, mesh=mesh, in_specs=(state_specs(), layout.EVAL_BATCH_SPEC, P()),
                                  out_specs=P()))
  return lambda state, batch, fused_bn=None: sharded(state, batch, fused_bn)


def mixture(pred, weights, axis_name: str):
  """The weighted mixture of all particles' predictive quantities (``[L, b, ...]`` leaves, ``[L]`` weights).

  A leaf is mixed linearly, ``sum_i w_i x_i``, unless its key starts with ``log_``: then it holds
  log-values (a log-density) and mixes as ``log sum_i w_i exp(x_i)``, computed stably (``pmax`` and
  ``psum`` over ``axis_name``), so that a density too small for float32 still counts. A particle with
  ``w_i = 0`` contributes nothing, even if its values are NaN.
  """

  def mix(path, x):
    if not (path and str(getattr(path[-1], "key", "")).startswith("log_")):
      return correction.weighted_sum(x, weights, axis_name)
    w = weights.reshape(weights.shape + (1,) * (x.ndim - 1))
    live = jnp.where(w > 0, x, -jnp.inf)
    m = lax.pmax(jnp.max(live, axis=0), axis_name)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    total = lax.psum(jnp.sum(jnp.where(w > 0, w * jnp.exp(live - m), 0.0), axis=0), axis_name)
    return m + jnp.log(total)

  return jax.tree_util.tree_map_with_path(mix, pred)


def padded(batches: Iterable[dict], batch_size: int):
  """Batches of exactly ``batch_size`` with a ``mask``: a batch that has none gets ones, a short one is
  zero-padded (mask 0), a long one split. Every example counts once."""
  for batch in batches:
    n = len(next(iter(batch.values())))
    batch = dict(batch)
    batch.setdefault("mask", np.ones(n, np.float32))
    for start in range(0, n, batch_size):
      part = {k: v[start:start + batch_size] for k, v in batch.items()}
      pad = batch_size - (min(n, start + batch_size) - start)
      if pad:
        part = {k: np.concatenate([v, np.zeros((pad,) + v.shape[1:], v.dtype)]) for k, v in part.items()}
      yield part


def _agreed(batches: Iterable[dict], across_processes: bool) -> Iterator[dict]:
  """``batches``, continued with all-masked copies of the last one until every process's have ended:
  each eval step runs on every process, and the parts of the eval set may differ by a batch."""
  if not across_processes:
    yield from batches
    return
  from jax.experimental import multihost_utils
  stream, last = iter(batches), None
  while True:
    batch = next(stream, None)
    has, can = multihost_utils.process_allgather(np.array([batch is not None, batch is not None or last is not None],
                                                          np.int32)).reshape(-1, 2).T
    if not has.any():
      return
    if not can.all():
      empty = [int(i) for i in np.flatnonzero(can == 0)]
      raise DataError(f"the evaluation parts of processes {empty} are empty while others are not: each process "
                      f"reads its own part of the eval set, so it needs at least as many examples as processes")
    if batch is None:
      batch = dict(last, mask=np.zeros_like(last["mask"]))
    last = batch
    yield batch


def evaluate(task: Task, eval_step, state, batches: Iterable[dict], batch_size: int, mesh, fused_bn=None,
             wait: Callable = lambda x: x, interrupted: Callable[[], bool] = lambda: False,
             process_local: bool = False) -> dict:
  """``task.finalize``d metrics of every row over ``batches`` (see ``padded``); ``weights`` ``[P]``.

  ``batches`` is the whole eval set, or (``process_local``) this process's part of it, every example in
  exactly one process's part; batches of ``layout.eval_batch_sizes(batch_size, mesh)`` (global, per
  process). ``interrupted()`` is asked between batches (raises ``InterruptedError``).
  """
  size, local = layout.eval_batch_sizes(batch_size, mesh)
  total = weights = None
  for batch in _agreed(padded(batches, local if process_local else size), process_local and jax.process_count() > 1):
    if interrupted():
      raise InterruptedError("stop requested")
    sums = wait(eval_step(state, layout.put_eval_batch(batch, mesh, process_local), fused_bn))
    weights = sums.pop("weights")
    total = sums if total is None else jax.tree.map(lambda a, b: a + b, total, sums)
  if total is None:
    raise DataError("the evaluation set is empty: eval_batches gave no batch")
  results = {k: (task.finalize_diversity if k == "diversity" else task.finalize)(v)
             for k, v in jax.device_get(total).items()}
  results["weights"] = np.asarray(jax.device_get(weights))
  return results


def brief(results: dict, calibration: Optional[dict] = None) -> dict:
  """Each row's (and each particle's) scalar metrics and reliability bins, without the histograms and
  temperature curves (a shifted set's results). With ``calibration`` (the held-out set's results), also
  ``temperature_scaled``: each row's NLL, ECE and Brier at the temperature fitted on it, as the test set's."""
  keep = lambda m, scalar: {k: v for k, v in m.items() if k in BRIEF or (k not in _CURVES and np.ndim(v) == scalar)}
  out = {k: keep(v, 1 if k == "particles" else 0) if isinstance(v, dict) else v for k, v in results.items()}
  scaled = temperature_scaled(calibration, results) if calibration is not None else {}
  if scaled:  # a task without tempered metrics (regression) has none
    out["temperature_scaled"] = scaled
  return out


_CURVES = ("selective_accuracy", "certainty_counts", "nll_by_temperature", "brier_by_temperature",
           "ece_by_temperature")


def temperature_scaled(calibration: dict, test: dict) -> dict:
  """For each row: the temperature ``T`` of ``metrics.TEMPERATURES`` with the lowest NLL on the
  calibration set, and the test set's NLL, ECE and Brier of the prediction tempered by it
  (``p ** (1 / T)`` renormalised; accuracy does not change). Rows without tempered metrics (tasks other
  than classification) are left out."""
  out = {}
  for _, key in ROWS:
    curve = np.asarray(calibration.get(key, {}).get("nll_by_temperature", np.nan))
    if np.isfinite(curve).any():
      i = int(np.nanargmin(curve))
      out[key] = {"temperature": float(metrics.TEMPERATURES[i]), "at_grid_edge": i in (0, len(curve) - 1),
                  **{m: float(test[key][f"{m}_by_temperature"][i]) for m in ("nll", "ece", "brier")}}
  return out


def ood_auroc(test: dict, ood: dict) -> dict:
  """OOD AUROC of each row and particle, by the maximum probability and by the predictive entropy
  (``metrics.certainty``): test examples as positives, the OOD set's as negatives."""
  out = {}
  for key in ("particles",) + tuple(k for _, k in ROWS):
    if "certainty_counts" in test.get(key, {}):
      a, b = np.asarray(test[key]["certainty_counts"]), np.asarray(ood[key]["certainty_counts"])
      out[key] = {"auroc_max_prob": metrics.auroc(a[..., 0, :], b[..., 0, :]),
                  "auroc_entropy": metrics.auroc(a[..., 1, :], b[..., 1, :])}
  return out


def format_extras(results: dict, columns: tuple) -> str:
  """Lines under the table: diversity, temperature scaling, shifts (mean over severities; accuracy and ECE,
  or the first two of the task's ``columns``; the ECE at the fitted temperature when there is one) and OOD."""
  lines = []
  if "diversity" in results and len(results["weights"]) > 1:
    d = results["diversity"]
    lines.append(f"diversity of the population: disagreement {d['disagreement']:.4f}, "
                 f"pairwise KL {d['pairwise_kl']:.4f}")
  for key, t in results.get("temperature_scaled", {}).items():
    r = results[key]
    edge = " (the grid's edge: the best T may lie beyond)" if t["at_grid_edge"] else ""
    lines.append(f"temperature scaling, {dict((k, n) for n, k in ROWS)[key]}: T = {t['temperature']:.3g}{edge}; NLL "
                 f"{r['nll']:.4f} -> {t['nll']:.4f}, ECE {r['ece']:.4f} -> {t['ece']:.4f}, Brier "
                 f"{r['brier']:.4f} -> {t['brier']:.4f}")
  shifts = results.get("shifts", {})
  if shifts:
    from ipf_jax.data.shifts import family
    families = {}
    for name, r in shifts.items():
      families.setdefault(family(name)[0], []).append(r)
    present = next(iter(shifts.values())).get("ensemble", {})
    shown = [c for c in columns if c[1] in ("accuracy", "ece") and c[1] in present] or [
        c for c in columns if c[1] in present][:2]
    rows_shown = [key for key in ("ensemble", "fused") if key in next(iter(shifts.values()))]
    scaled = next(iter(shifts.values())).get("temperature_scaled", {})
    cells = []  # (heading, value of one set's results, format)
    for key in rows_shown:
      cells += [(f"{key} {title}", lambda r, key=key, metric=metric: r[key][metric], fmt)
                for title, metric, fmt in shown]
      if key in scaled:
        cells.append((f"{key} ECE at T", lambda r, key=key: r["temperature_scaled"][key]["ece"], "{:.4f}"))
    rows = [("shift (mean over severities)",) + tuple(heading for heading, _, _ in cells)]
    for name, rs in families.items():
      rows.append((name,) + tuple(fmt.format(np.mean([get(r) for r in rs])) for _, get, fmt in cells))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines += ["  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths)))
              for r in rows]
  ood = results.get("ood_sets") or ({results.get("ood_dataset", "OOD set"): results["ood"]} if "ood" in results
                                    else {})
  for name, by_row in ood.items():
    for key, a in by_row.items():
      if key != "particles":
        lines.append(f"OOD AUROC ({name}), {dict((k, n) for n, k in ROWS)[key]}: "
                     f"max prob {a['auroc_max_prob']:.4f}, entropy {a['auroc_entropy']:.4f}")
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
  widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
  lines = ["  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))) for r in rows]
  lines.insert(1, "-" * len(lines[0]))
  if not shared_init:
    lines.append("(independent inits: the fused model averages unrelated networks and is not meaningful)")
  return "\n".join(lines)

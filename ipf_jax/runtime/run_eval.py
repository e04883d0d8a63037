"""A run's evaluations: the test set and what the config adds (temperature scaling fitted on a held-out
part of the train split, the shifted sets, OOD AUROC), the final table, ``eval_results.json`` and the
exported fused model. ``trainer._Run`` holds one ``Evaluations``."""

from __future__ import annotations

import itertools
import json
import logging
import os
from typing import Callable, Optional

import jax
import ml_collections
import numpy as np

from ipf_jax import files
from ipf_jax.config import read, sync, validation
from ipf_jax.evaluation import results as results_lib
from ipf_jax.reporting import export, tables
from ipf_jax.runtime import workdir as workdir_lib
from ipf_jax.spmd import eval_step, fusion, layout
from ipf_jax.spmd.mesh import one_program_at_a_time

log = logging.getLogger("ipf_jax")


def hold_out(config: ml_collections.ConfigDict, dataset, data_given: bool):
  """``(dataset, calibration)``: with ``calibration_fraction``, the train split without its held-out part and
  that part as an evaluation set; else ``(dataset, None)``. Refuses shifted and OOD sets with data you pass
  (``data_given``): they are the built-in data's."""
  if data_given and (config.eval_shifts or config.ood_dataset):
    raise validation.ConfigError(
      "eval_shifts" if config.eval_shifts else "ood_dataset",
      "the shifted and OOD sets are those of config.dataset's built-in data; with "
      "your own data, evaluate your own sets (eval_step.evaluate); set it to ''",
    )
  if not config.calibration_fraction:
    return dataset, None
  if getattr(dataset, "calibration", None) is None:
    if not hasattr(dataset, "holdout"):
      raise validation.ConfigError(
        "calibration_fraction",
        f"the data {dataset.name!r} cannot hold out part of its train split "
        "(in-memory datasets can: digits, ArrayDataset); set it to 0",
      )
    dataset = dataset.holdout(config.calibration_fraction)
  return dataset, dataset.calibration


def device_batches(config: ml_collections.ConfigDict, dataset, spec, mesh, start_step: int):
  """The run's train batches from ``start_step``, laid out and placed on the devices."""
  return (
    layout.put_train_batch(b, spec.num_particles, mesh, dataset.process_local)
    for b in dataset.train_batches(start_step, config.global_batch_size, config.seed)
  )


class Evaluations:
  """A run's evaluations: the test set, the held-out ``calibration`` set (``hold_out``), the shifted and OOD
  sets the config names, the final table and the files it writes. ``zoo``: the task is the config's (the
  export names its model)."""

  def __init__(self, config: ml_collections.ConfigDict, dataset, calibration, task, parts, workdir: str, zoo: bool):
    self.config, self.dataset, self.calibration, self.task, self.parts = config, dataset, calibration, task, parts
    self.workdir, self.zoo, self.mesh, self.spec = workdir, zoo, parts.mesh, parts.spec
    self.shift_sets = read.eval_sets(config, dataset)
    self.ood_sets = read.ood_sets(config, dataset)

  def fused_bn(self, state, interrupted: Callable[[], bool] = lambda: False):
    """The fused model's BatchNorm statistics averaged over ``fused_bn_batches`` training batches
    (the first ones of the run's data order), or ``None`` when that is 0."""
    n = self.config.fused_bn_batches
    if not n:
      return None
    batches = device_batches(self.config, self.dataset, self.spec, self.mesh, 0)
    return fusion.reestimate_bn(
      self.parts.fused_bn_fn, state, itertools.islice(batches, n), one_program_at_a_time, interrupted
    )

  def evaluate(self, state, fused_bn=None, interrupted: Callable[[], bool] = lambda: False, source=None) -> dict:
    """Metrics on the test set (or ``source``'s). Each process reads its own part of the set when the
    source can (``eval_process_local``)."""
    return self._evaluate(state, fused_bn, interrupted, source)[0]

  def _evaluate(self, state, fused_bn, interrupted, source=None) -> tuple[dict, int]:
    """``(results, examples this process read)``."""
    source = self.dataset if source is None else source
    local = getattr(source, "eval_process_local", False)
    size, per_process = layout.eval_batch_sizes(
      self.config.eval_batch_size, self.mesh, getattr(source, "test_size", None)
    )
    seen = [0]

    def counted(batches):
      for batch in batches:
        seen[0] += len(next(iter(batch.values())))
        yield batch

    results = eval_step.evaluate(
      self.task,
      self.parts.eval_step,
      state,
      counted(source.eval_batches(per_process if local else size)),
      size,
      self.mesh,
      fused_bn,
      one_program_at_a_time,
      interrupted,
      process_local=local,
    )
    return results, seen[0]

  def evaluate_more(self, state, results: dict, fused_bn=None, interrupted: Callable[[], bool] = lambda: False):
    """What the config asks for beyond the test set: temperature scaling fitted on the held-out part of
    the train split, each shifted set (``results_lib.brief``; with the held-out part, also at its fitted
    temperature) and OOD AUROC against each OOD set (``ood_sets``; the first also as ``ood``, with its name
    as ``ood_dataset``)."""
    more, calibration = {}, None
    if self.calibration is not None:
      calibration = self.evaluate(state, fused_bn, interrupted, self.calibration)
      more["temperature_scaled"] = results_lib.temperature_scaled(calibration, results)
      more["calibration_examples"] = self.calibration.test_size
    if self.shift_sets:  # with a calibration set, each also at the temperature fitted on it (before the curves go)
      more["shifts"] = {
        name: results_lib.brief(self.evaluate(state, fused_bn, interrupted, source), calibration)
        for name, source in self.shift_sets.items()
      }
    if self.ood_sets:
      more["ood_sets"] = {
        name: results_lib.ood_auroc(results, self.evaluate(state, fused_bn, interrupted, source))
        for name, source in self.ood_sets.items()
      }
      more["ood_dataset"], more["ood"] = next(iter(more["ood_sets"].items()))
    return more

  def finish(self, state, writer=None, suffix: str = "", interrupted: Callable[[], bool] = lambda: False) -> dict:
    """Final evaluation table, ``eval_results{suffix}.json`` and the exported fused model
    ``fused_model{suffix}`` (with re-estimated BatchNorm statistics when ``fused_bn_batches`` > 0).
    A file that cannot be written (full disk) is reported and skipped: the table is already printed."""
    fused_bn = self.fused_bn(state, interrupted)
    results, seen = self._evaluate(state, fused_bn, interrupted)
    results.update(self.evaluate_more(state, results, fused_bn, interrupted))
    step = int(state.step)
    size = self.dataset.test_size
    extras = tables.format_extras(results, self.task.columns, sync.resolve(self.config) != "step")
    log.info(
      "final evaluation at step %d on %s %s test examples%s:\n%s%s",
      step,
      size if size else "the",
      self.dataset.name,
      f" (process 0 read {seen}: each process reads its own part)" if jax.process_count() > 1 and seen != size else "",
      tables.format_table(results, self.task.columns, self.spec.shared_init),
      "\n" + extras if extras else "",
    )
    variables, _ = self.parts.fuse(state)
    if fused_bn is not None:
      variables = {**variables, "batch_stats": fused_bn}
    if writer is not None:
      writer.eval_results(step, results)
    if jax.process_index() == 0:
      path = os.path.join(self.workdir, f"eval_results{suffix}.json")
      try:
        keep_narrowed(path, results)
      except OSError as e:
        log.error(
          "could not keep %s before replacing it (%s; %s): it is left as it was, and neither this "
          "evaluation's results nor its fused model are written",
          path,
          e.strerror or e,
          workdir_lib.free_space(self.workdir),
        )
        return results
      try:
        files.write_atomic(
          path, json.dumps({"step": step, **jax.tree.map(lambda x: np.asarray(x).tolist(), results)}, indent=1)
        )
        fields = read.model_spec(self.config, self.dataset.num_classes).fields() if self.zoo else None
        export.export_fused(variables, os.path.join(self.workdir, f"fused_model{suffix}"), fields)
      except OSError as e:
        log.error(
          "could not write %s or the fused model (%s; %s)", path, e.strerror or e, workdir_lib.free_space(self.workdir)
        )
    return results


def _coverage(results: dict) -> set:
  """What an evaluation holds: its rows and extras, each shifted set, and the OOD set's name."""
  out = {k for k in results if k != "step"} | {f"shifts/{k}" for k in results.get("shifts", {})}
  out |= {f"ood_sets/{k}" for k in results.get("ood_sets", {})}
  return out | ({f"ood_dataset={results['ood_dataset']}"} if "ood_dataset" in results else set())


def keep_narrowed(path: str, results: dict) -> Optional[str]:
  """Before ``results`` replace the evaluation in ``path``: when that file holds something they lack (a
  shifted set, the OOD set, a temperature, a row; say a rerun with fewer ``eval_shifts``) or cannot be read
  as an evaluation, it is first copied to ``<name>.replaced.json`` (``.replaced.2.json``, ... if taken)
  and a warning names it. Returns that path (``None``: nothing to keep). Raises ``OSError`` when the file is
  there but cannot be read, or the copy cannot be written, so the caller leaves the old file as it is."""
  try:
    with open(path, "rb") as f:
      held = f.read()
    old = json.loads(held)
    lost = sorted(_coverage(old) - _coverage(results))
    why = (
      f"held the evaluation of step {old.get('step')} with {', '.join(lost[:6])}"
      f"{', ...' if len(lost) > 6 else ''}, which this evaluation lacks"
    )
  except FileNotFoundError:  # none yet
    return None
  except OSError:  # there but unreadable: it cannot be kept either, so the caller leaves it as it is
    raise
  except (ValueError, AttributeError, TypeError):  # not an evaluation: kept whole, not ours to judge
    lost, why = ["all of it"], "is not an evaluation this run can read"
  if not lost:
    return None
  stem = path[: -len(".json")]
  keep = next(
    c for c in (f"{stem}.replaced{'' if i == 1 else f'.{i}'}.json" for i in itertools.count(1)) if not os.path.exists(c)
  )
  files.write_atomic(keep, held)
  log.warning("%s %s: it is kept as %s", os.path.basename(path), why, os.path.basename(keep))
  return keep

"""Experiment trackers beside TensorBoard: MLflow and Weights & Biases (``config.trackers``).

Each receives what the TensorBoard writer writes (every scalar at its step), the flattened config as parameters
once, and at the end of a run its files as artifacts (the fused model, ``eval_results.json``, the report's
pictures). Only process 0 tracks (``summary.SummaryWriter`` makes them there). A resumed run continues the same
tracker run: its id is kept in ``WORKDIR/trackers.json``. A tracker that fails (a server gone) costs one warning
and that tracker's later writes, never the run or a checkpoint.

  --config.trackers=tensorboard,mlflow      # MLflow's server from MLFLOW_TRACKING_URI, as its own clients read it
  --config.trackers=tensorboard,wandb       # W&B's own settings from its environment (WANDB_MODE, WANDB_PROJECT,
                                            # WANDB_ENTITY, WANDB_API_KEY); its local files under WORKDIR/wandb
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import time

IDS_FILE = "trackers.json"
# MLflow's own defaults (7 retries with backoff, 120 s a request) would hold a step for minutes when its server is
# gone; a user's MLFLOW_HTTP_REQUEST_* settings win.
BOUNDED = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


def parse(trackers: str) -> tuple[str, ...]:
  """``"tensorboard,mlflow"`` -> ``("tensorboard", "mlflow")`` (checked with their packages by
  ``validation``: an unknown name or a missing package is a ``ConfigError`` naming the extra)."""
  return tuple(t.strip() for t in trackers.split(",") if t.strip())


def flatten(tree: dict, prefix: str = "") -> dict:
  """``{"a": {"b": 1}}`` -> ``{"a.b": "1"}``: a config as tracker parameters (strings)."""
  out = {}
  for key, value in tree.items():
    name = f"{prefix}{key}"
    if isinstance(value, dict):
      out.update(flatten(value, name + "."))
    else:
      out[name] = json.dumps(value) if isinstance(value, (list, tuple)) else str(value)
  return out


def _ids(workdir: str) -> dict:
  path = os.path.join(workdir, IDS_FILE)
  return json.load(open(path)) if os.path.isfile(path) else {}


def _keep_id(workdir: str, name: str, run_id: str) -> None:
  from ipf_jax import files

  files.write_atomic(os.path.join(workdir, IDS_FILE), json.dumps({**_ids(workdir), name: run_id}, indent=2))


class Sink:
  """One tracker: ``scalars``, ``artifacts``, ``close``; after its first failure a warning and nothing more."""

  name = ""

  def __init__(self):
    self.failed = False

  def guard(self, fn, *args) -> None:
    if self.failed:
      return
    try:
      fn(*args)
    except Exception as e:  # noqa: BLE001 - any failure of a tracker's client: a warning, never the run
      self.failed = True
      print(f"warning: {self.name} tracking stopped ({type(e).__name__}: {e}); training goes on", file=sys.stderr)


class MlflowSink(Sink):
  """MLflow through ``MlflowClient`` (the tracking URI from ``MLFLOW_TRACKING_URI``, or MLflow's default)."""

  name = "mlflow"

  def __init__(self, workdir: str, config: dict, run_name: str):
    super().__init__()
    from mlflow.tracking import MlflowClient

    for name, value in BOUNDED.items():  # a dead server stalls a step at most this long, then the sink stops
      os.environ.setdefault(name, value)
    self.client, self.run_id = MlflowClient(), _ids(workdir).get("mlflow")
    if self.run_id is not None and not self._exists(self.run_id):
      print(f"warning: mlflow run {self.run_id} (trackers.json) is not on this server; a new run", file=sys.stderr)
      self.run_id = None
    if self.run_id is None:
      experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", "ipf-jax")
      found = self.client.get_experiment_by_name(experiment)
      experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
      self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
      _keep_id(workdir, "mlflow", self.run_id)
      self.guard(self._params, flatten(config))
    else:
      self.guard(self.client.update_run, self.run_id, "RUNNING")

  def _exists(self, run_id: str) -> bool:
    try:
      self.client.get_run(run_id)
      return True
    except Exception:  # noqa: BLE001 - MlflowException (not found) or the server's own error
      return False

  def _params(self, params: dict) -> None:
    from mlflow.entities import Param

    items = [Param(k, v[:6000]) for k, v in sorted(params.items())]
    for i in range(0, len(items), 100):  # MLflow's batch limit
      self.client.log_batch(self.run_id, params=items[i : i + 100])

  def scalars(self, step: int, values: dict) -> None:
    from mlflow.entities import Metric

    stamp = int(time.time() * 1000)
    metrics = [Metric(k, float(v), stamp, int(step)) for k, v in values.items()]
    for i in range(0, len(metrics), 1000):
      self.guard(lambda chunk: self.client.log_batch(self.run_id, metrics=chunk), metrics[i : i + 1000])

  def artifacts(self, paths: list[str]) -> None:
    for path in paths:
      self.guard(self.client.log_artifact, self.run_id, path)

  def close(self, finished: bool) -> None:
    self.guard(self.client.set_terminated, self.run_id, "FINISHED" if finished else "KILLED")


class WandbSink(Sink):
  """Weights & Biases through ``wandb.init`` (online, or ``WANDB_MODE=offline`` for ``wandb sync`` later; project
  ``WANDB_PROJECT``, default ``ipf-jax``). Its files go under ``WORKDIR/wandb``; a resume continues the same run id
  (``resume="allow"``). W&B keeps one value a step and refuses steps that go back (a replay after a rewind or a
  SIGKILL resume): those it drops with its own warning."""

  name = "wandb"

  def __init__(self, workdir: str, config: dict, run_name: str):
    super().__init__()
    import wandb

    resumed = _ids(workdir).get("wandb")
    run_id = resumed or secrets.token_hex(4)  # W&B's ids: lower-case letters and digits
    # login_timeout: a run started at a terminal without W&B's credentials waits at most this long at its prompt
    settings = wandb.Settings(console="off", quiet=True, save_code=False, disable_git=True, login_timeout=60)
    self.run = wandb.init(
      project=os.environ.get("WANDB_PROJECT", "ipf-jax"),
      name=run_name,
      id=run_id,
      resume="allow",
      dir=workdir,
      config=None if resumed else config,  # the run's first config, as MLflow's parameters
      settings=settings,
    )
    _keep_id(workdir, "wandb", run_id)

  def scalars(self, step: int, values: dict) -> None:
    self.guard(self.run.log, {k: float(v) for k, v in values.items()}, int(step))

  def artifacts(self, paths: list[str]) -> None:
    for path in paths:  # copies in the run's folder, which W&B uploads at the end (a symlink would follow a resume)
      self.guard(shutil.copy2, path, os.path.join(self.run.dir, os.path.basename(path)))

  def close(self, finished: bool) -> None:
    self.guard(self.run.finish, 0 if finished else 1)


SINKS = {"mlflow": MlflowSink, "wandb": WandbSink}


def open_sinks(names, workdir: str, config: dict) -> list[Sink]:
  """The sinks of the named trackers (TensorBoard is the summary writer itself); a tracker whose client cannot
  start (an unreachable server) is a warning and left out."""
  sinks = []
  for name in names:
    if name == "tensorboard":
      continue
    sink = Sink()
    sink.name = name
    sink.guard(lambda: sinks.append(SINKS[name](workdir, config, os.path.basename(os.path.abspath(workdir)))))
  return sinks

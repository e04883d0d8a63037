"""``config.trackers=tensorboard,mlflow`` against a real MLflow tracking server on 127.0.0.1 (SQLite store in a
temporary folder, a free port, stopped by the test): a run and its resume are one MLflow run with the scalars
TensorBoard got at the same steps, the config as parameters, the final evaluation and the run's files; a
server that dies mid-run costs a warning, never the run or its checkpoints. ``trackers=...,wandb`` in W&B's
offline mode, its record files read back (``wandb_records``): the same."""

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from ipf_jax.config import validation
from ipf_jax.reporting import report
from tests import helpers

pytestmark = pytest.mark.slow  # CI: leg 1 only (pytest.ini)

# A dead server must not stall the run in MLflow's retries (each sink gives up at its first failure).
FAST_FAIL = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture
def mlflow_server(tmp_path):
  port = free_port()
  proc = subprocess.Popen(
    [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
     "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}", "--default-artifact-root", str(tmp_path / "store")],
    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
  )  # fmt: skip
  uri = f"http://127.0.0.1:{port}"
  deadline = time.monotonic() + 180
  while True:
    try:
      urllib.request.urlopen(f"{uri}/health", timeout=2)
      break
    except OSError:
      assert proc.poll() is None and time.monotonic() < deadline, "the MLflow server did not start"
      time.sleep(1)
  yield uri, proc
  if proc.poll() is None:
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)


def test_a_run_and_its_resume_are_one_mlflow_run(tmp_path, mlflow_server):
  from mlflow.tracking import MlflowClient

  uri, _ = mlflow_server
  env = {"MLFLOW_TRACKING_URI": uri, "MLFLOW_EXPERIMENT_NAME": "test", **FAST_FAIL}
  workdir = tmp_path / "run"
  flags = ("--config.log_every_steps=1", "--config.trackers=tensorboard,mlflow", "--config.checkpoint_every_steps=2")
  r = helpers.run_train_py(workdir, "--config.num_train_steps=3", *flags, env=env)
  assert r.returncode == 0, r.stdout + r.stderr
  r = helpers.run_train_py(workdir, "--config.num_train_steps=6", *flags, env=env)  # resumed at step 3
  assert r.returncode == 0 and "resumed from" in r.stdout, r.stdout + r.stderr
  assert "warning" not in r.stderr, r.stderr
  client = MlflowClient(uri)
  (run,) = client.search_runs([client.get_experiment_by_name("test").experiment_id])
  assert run.info.run_id == json.load(open(workdir / "trackers.json"))["mlflow"]
  assert run.info.status == "FINISHED"
  events = report.read_scalars(str(workdir))  # what TensorBoard got, read back from the event files
  for tag in ("train/loss", "train/ess", "particle/weight/3"):
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, tag))
    steps, values = events[tag]
    assert [s for s, _ in history] == list(steps) == [1, 2, 3, 4, 5, 6], tag
    np.testing.assert_allclose([v for _, v in history], values, rtol=1e-6, err_msg=tag)
  results = json.load(open(workdir / "eval_results.json"))
  np.testing.assert_allclose(run.data.metrics["eval/ensemble/accuracy"], results["ensemble"]["accuracy"], rtol=1e-6)
  assert run.data.params["num_particles"] == "8" and run.data.params["mode"] == "ipf"
  assert run.data.params["num_train_steps"] == "3", "parameters are the run's first config"
  artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
  assert {"fused_model.msgpack", "eval_results.json", "config.json", "weights.png"} <= artifacts, artifacts


def test_a_tracker_that_dies_mid_run_costs_a_warning_not_the_run(tmp_path, mlflow_server):
  uri, server = mlflow_server
  env = dict(os.environ, JAX_PLATFORMS="cpu", MLFLOW_TRACKING_URI=uri, **FAST_FAIL)
  workdir = tmp_path / "run"
  argv = helpers.train_py_argv(workdir, "--config.num_train_steps=12", "--config.log_every_steps=1",
                               "--config.trackers=tensorboard,mlflow", "--config.checkpoint_every_steps=4")  # fmt: skip
  proc = subprocess.Popen(argv, cwd=helpers.ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  for line in proc.stdout:
    if "step 2/12" in line:
      os.killpg(server.pid, signal.SIGKILL)  # the server dies mid-run
      break
  out, err = proc.communicate(timeout=600)
  assert proc.returncode == 0, out + err
  assert err.count("warning: mlflow tracking stopped") == 1, err
  assert "step 12/12" in out and os.path.isdir(workdir / "checkpoints" / "12")


def test_an_unknown_tracker_names_the_field():
  with pytest.raises(validation.ConfigError) as e:
    validation.validate(helpers.tiny_config(trackers="tensorboard,neptune"), 8)
  assert e.value.field == "trackers" and "mlflow" in str(e.value)


def wandb_records(path: str):
  """The records of a W&B run file (``run-ID.wandb``: LevelDB's log format, 32 KiB blocks of chunks with a 7-byte
  header (crc32, length, type: 1 whole, 2 first, 3 middle, 4 last) after W&B's own 7-byte header), each a
  ``wandb_internal_pb2.Record``: W&B's Python package no longer reads them back itself."""
  from wandb.proto import wandb_internal_pb2

  data = open(path, "rb").read()
  ident, magic, _ = struct.unpack("<4sHB", data[:7])
  assert (ident, magic) == (b":W&B", 0xBEE1), path
  pos, block, chunks = 7, 32768, b""
  while pos + 7 <= len(data):
    left = block - pos % block
    _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
    if left < 7 or kind == 0:  # a block's tail too short for a header, or its zero padding
      pos += left
      continue
    chunks += data[pos + 7 : pos + 7 + length]
    pos += 7 + length
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(chunks)
      chunks = b""
      yield record


def wandb_items(items) -> dict:
  return {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in items}


def test_a_run_and_its_resume_are_one_wandb_run(tmp_path):
  workdir = tmp_path / "run"
  env = {"WANDB_MODE": "offline", "WANDB_PROJECT": "test", "WANDB_SILENT": "true"}
  flags = ("--config.log_every_steps=1", "--config.trackers=tensorboard,wandb", "--config.checkpoint_every_steps=2")
  r = helpers.run_train_py(workdir, "--config.num_train_steps=3", *flags, env=env)
  assert r.returncode == 0 and "tracking stopped" not in r.stderr, r.stdout + r.stderr
  r = helpers.run_train_py(workdir, "--config.num_train_steps=6", *flags, env=env)  # resumed at step 3
  assert r.returncode == 0 and "resumed from" in r.stdout, r.stdout + r.stderr
  assert "tracking stopped" not in r.stderr, r.stderr
  run_id = json.load(open(workdir / "trackers.json"))["wandb"]
  folders = sorted((workdir / "wandb").glob(f"offline-run-*-{run_id}"))
  assert len(folders) == 2, folders  # one folder a process, one run id: `wandb sync` uploads them in order as one run
  runs, configs, history, summary, exits = [], [], {}, {}, []
  for folder in folders:
    for record in wandb_records(str(folder / f"run-{run_id}.wandb")):
      kind = record.WhichOneof("record_type")
      if kind == "run":
        runs.append((record.run.run_id, record.run.project))
        configs.append(wandb_items(record.run.config.update))
      elif kind == "history":
        row = wandb_items(record.history.item)
        for tag, value in row.items():
          history.setdefault(tag, []).append((row["_step"], value))
      elif kind == "summary":
        summary.update(wandb_items(record.summary.update))
      elif kind == "exit":
        exits.append(record.exit.exit_code)
  assert runs == [(run_id, "test")] * 2 and exits == [0, 0]
  assert configs[0]["num_particles"] == 8 and configs[0]["mode"] == "ipf" and configs[0]["num_train_steps"] == 3
  assert "num_train_steps" not in configs[1], "parameters are the run's first config"
  events = report.read_scalars(str(workdir))  # what TensorBoard got, read back from the event files
  for tag in ("train/loss", "train/ess", "particle/weight/3"):
    steps, values = events[tag]
    assert [s for s, _ in history[tag]] == list(steps) == [1, 2, 3, 4, 5, 6], tag
    np.testing.assert_allclose([v for _, v in history[tag]], values, rtol=1e-6, err_msg=tag)
  results = json.load(open(workdir / "eval_results.json"))
  np.testing.assert_allclose(summary["eval/ensemble/accuracy"], results["ensemble"]["accuracy"], rtol=1e-6)
  saved = {p.name for p in (folders[1] / "files").iterdir()}
  assert {"fused_model.msgpack", "eval_results.json", "config.json", "weights.png"} <= saved, saved

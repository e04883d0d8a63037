"""What a run leaves in its workdir: TensorBoard events, pictures, --eval_only, the exported fused model."""

import json
import os

import jax
import numpy as np
import pytest

import ipf_jax
from ipf_jax.reporting import report
from tests import helpers

pytestmark = pytest.mark.slow  # CI: leg 1 only (pytest.ini)

STEPS = 20


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("run")
  r = helpers.run_train_py(
    workdir,
    f"--config.num_train_steps={STEPS}",
    "--config.log_every_steps=5",
    "--config.eval_every_steps=10",
    "--config.fused_bn_batches=4",
  )
  assert r.returncode == 0, r.stdout + r.stderr
  return workdir, r.stdout


def table(out):
  return out[out.index("final evaluation") :].split("\n", 1)[1].strip()


def test_tensorboard_events_hold_every_step(run):
  workdir, _ = run
  scalars = report.read_scalars(str(workdir))
  for tag in ["train/loss", "train/ess", "train/lr", "train/max_weight", "train/grad_norm", "resample/event"]:
    steps, values = scalars[tag]
    np.testing.assert_array_equal(steps, np.arange(1, STEPS + 1)), tag
  for tag in ["train/diversity", "train/images_per_s", "train/resamples"]:
    np.testing.assert_array_equal(scalars[tag][0], [5, 10, 15, 20])
  for i in range(8):
    assert f"particle/loss/{i}" in scalars and f"particle/weight/{i}" in scalars
  weights = np.stack([scalars[f"particle/weight/{i}"][1] for i in range(8)])
  np.testing.assert_allclose(weights.sum(0), 1.0, rtol=1e-4)
  results = json.load(open(workdir / "eval_results.json"))
  for model in ["ensemble", "fused", "fused_bn", "particle_3"]:
    steps, values = scalars[f"eval/{model}/accuracy"]
    np.testing.assert_array_equal(steps, [10, STEPS])
  assert scalars["eval/fused/accuracy"][1][-1] == pytest.approx(results["fused"]["accuracy"], rel=1e-6)
  assert scalars["eval/fused_bn/nll"][1][-1] == pytest.approx(results["fused_bn"]["nll"], rel=1e-6)
  events = scalars["resample/event"][1]
  if events.any():  # ancestors are logged exactly at the resampling steps
    assert set(scalars["resample/ancestor/0"][0]) == set(scalars["resample/event"][0][events > 0])


def test_report_writes_pictures(run, tmp_path, capsys):
  workdir, _ = run
  (tmp_path / "shifts.png").write_bytes(b"an earlier report's")  # this run has no shifted sets
  report.main([str(workdir), "--out", str(tmp_path)])
  out = capsys.readouterr().out
  assert f"note: {tmp_path / 'shifts.png'} is from an earlier report; this run's results have nothing for it" in out
  assert (tmp_path / "shifts.png").read_bytes() == b"an earlier report's", "kept, not deleted"
  paths = report.write_report(str(workdir), str(tmp_path))
  assert [p.rsplit("/", 1)[1] for p in paths] == [
    "training_curves.png",
    "weights.png",
    "genealogy.png",
    "eval.png",
    "calibration.png",
  ]
  for p in paths:
    data = open(p, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_eval_only_prints_the_final_table(run):
  workdir, out = run
  r = helpers.run_train_py(workdir, f"--config.num_train_steps={STEPS}", "--config.fused_bn_batches=4", "--eval_only")
  assert r.returncode == 0, r.stdout + r.stderr
  assert f"evaluating {workdir / 'checkpoints' / str(STEPS)} at step {STEPS}" in r.stdout
  assert "resumed from" not in r.stdout
  assert "differs from the checkpoint's" not in r.stdout, "fused_bn_batches says how to evaluate, not what to train"
  assert table(r.stdout) == table(out)


def test_a_rerun_that_evaluates_less_keeps_the_evaluation_it_replaces(run, tmp_path):
  """A finished run rerun without ``fused_bn_batches``: it only evaluates, and the earlier ``eval_results.json``
  (which has the BN-re-estimated row) is kept, byte for byte, as ``eval_results.replaced.json``."""
  import shutil

  workdir = tmp_path / "copy"
  shutil.copytree(run[0], workdir)
  before = (workdir / "eval_results.json").read_bytes()
  r = helpers.run_train_py(workdir, f"--config.num_train_steps={STEPS}")
  assert r.returncode == 0, r.stdout + r.stderr
  assert (
    "eval_results.json held the evaluation of step 20 with fused_bn, which this evaluation lacks: it is kept as "
    "eval_results.replaced.json" in r.stdout
  )
  assert (workdir / "eval_results.replaced.json").read_bytes() == before
  assert "fused_bn" not in json.load(open(workdir / "eval_results.json"))


def test_keep_narrowed_against_the_files_it_finds(tmp_path):
  """Which replacements keep the old file, and under which names: a narrower evaluation or a file that is not
  one keeps it, a wider evaluation or no file keeps nothing."""
  from ipf_jax.runtime import run_eval

  wide = {"step": 20, "ensemble": {}, "shifts": {"contrast_1": {}, "blur_1": {}}, "ood": {}, "ood_dataset": "photos"}
  path = tmp_path / "eval_results.step20.json"
  path.write_text(json.dumps(wide))
  narrow = {"ensemble": {}, "shifts": {"contrast_1": {}}, "ood": {}, "ood_dataset": "photos"}
  assert run_eval.keep_narrowed(str(path), narrow) == str(tmp_path / "eval_results.step20.replaced.json")
  assert run_eval.keep_narrowed(str(path), narrow) == str(tmp_path / "eval_results.step20.replaced.2.json")
  for kept in ("eval_results.step20.replaced.json", "eval_results.step20.replaced.2.json"):
    assert json.loads((tmp_path / kept).read_text()) == wide
  assert json.loads(path.read_text()) == wide, "keep_narrowed copies; only the caller replaces"
  assert run_eval.keep_narrowed(str(path), {**wide, "fused_bn": {}}) is None  # more than before: nothing lost
  assert run_eval.keep_narrowed(str(path), {**wide, "ood_dataset": "other"}) is not None  # another OOD set
  assert run_eval.keep_narrowed(str(tmp_path / "absent.json"), narrow) is None
  (tmp_path / "bad.json").write_text("{not json")
  assert run_eval.keep_narrowed(str(tmp_path / "bad.json"), narrow) == str(tmp_path / "bad.replaced.json")
  assert (tmp_path / "bad.replaced.json").read_text() == "{not json"


def test_eval_only_without_checkpoint_is_a_clear_error(tmp_path):
  r = helpers.run_train_py(tmp_path, "--eval_only")  # an existing workdir without checkpoints
  assert r.returncode != 0 and "error: --eval_only: no checkpoint in" in r.stderr and "Traceback" not in r.stderr
  assert "starting a new run" not in r.stdout, "--eval_only starts nothing"
  assert os.listdir(tmp_path) == [], "a reader creates nothing"


def test_exported_fused_model_reproduces_its_accuracy(run):
  """The export carries the re-estimated BatchNorm statistics (the run sets fused_bn_batches)."""
  workdir, out = run
  assert "fused model, BN re-estimated" in table(out)
  model, variables = ipf_jax.load_fused(str(workdir / "fused_model"))
  data = helpers.digits_data()
  logits = jax.jit(lambda v, x: model.apply(v, x, train=False))(variables, data.test["image"])
  accuracy = float(np.mean(np.argmax(logits, -1) == data.test["label"]))
  logp = jax.nn.log_softmax(logits)
  nll = -float(np.mean(np.asarray(logp)[np.arange(len(data.test["label"])), data.test["label"]]))
  expected = json.load(open(workdir / "eval_results.json"))["fused_bn"]
  n = len(data.test["label"])  # the same examples right: float32 and float64 fractions of n differ in the last bit
  assert round(accuracy * n) == round(expected["accuracy"] * n)
  assert nll == pytest.approx(expected["nll"], rel=1e-4)
  assert accuracy > 0.5


def test_report_reads_eval_only_results_of_a_run_that_did_not_finish(tmp_path):
  """No eval_results.json: the newest eval_results.step<N>.json (by step, not by name); once the run finishes,
  its own."""
  assert report.results_path(str(tmp_path)) is None
  for step in (5, 20, 100):
    (tmp_path / f"eval_results.step{step}.json").write_text(f'{{"step": {step}}}')
  (tmp_path / "eval_results.step7.json.tmp").write_text("{}")
  assert report.read_results(str(tmp_path)) == {"step": 100}
  (tmp_path / "eval_results.json").write_text('{"step": 300}')
  assert report.read_results(str(tmp_path)) == {"step": 300}

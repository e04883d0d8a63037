"""examples/colab.ipynb executed headless on the CPU (nbclient) against this checkout: set-up without
installing, the digits run (a short one, with the tests' smaller CNN), the report's pictures inline, the
fused model's predictions, the CIFAR-10 section skipped by its parameter, and the last cell replaying the
recorded run after the fact, as after a disconnect (it resumes, and the finished run only evaluates)."""

import os

import pytest

from tests import helpers

pytestmark = pytest.mark.slow  # CI: leg 1 only (pytest.ini)

NOTEBOOK = os.path.join(helpers.ROOT, "examples", "colab.ipynb")


def _text(cell):
  return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")


def test_colab_notebook_runs_headless_and_resumes(tmp_path):
  import nbclient  # test extras (requirements.txt); here, so that CI's leg 2 collects the module without them
  import nbformat

  nb = nbformat.read(NOTEBOOK, as_version=4)
  params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
  assert len(params) == 1 and params[0].cell_type == "code"
  params[0].source += (
    f"\nCODE_DIR = {helpers.ROOT!r}\nWORKDIR = {str(tmp_path / 'runs')!r}\nDIGITS_STEPS = 6\n"
    f"EXTRA_FLAGS = {helpers.TEST_CNN!r}\nINSTALL = False\nTRAIN_CIFAR = False\nOWN_MODEL_STEPS = 6\n"
  )
  client = nbclient.NotebookClient(
    nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
  )
  client.execute(env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=helpers.ROOT))
  code = [c for c in nb.cells if c.cell_type == "code"]
  setup, digits, pictures, fused, own, cifar, resume = code[1:]
  assert "accelerator: cpu" in _text(setup) and f"runs: {tmp_path / 'runs'}" in _text(setup)
  assert "step 6/6" in _text(digits) and "final evaluation at step 6" in _text(digits)
  images = [o for o in pictures.outputs if "image/png" in o.get("data", {})]
  assert len(images) >= 4 and "weights.png" in _text(pictures)
  assert "fused model: " in _text(fused) and "on 450 test digits" in _text(fused)
  assert "your model: ensemble" in _text(own) and "step 6/6" in _text(own)
  assert os.path.isfile(tmp_path / "runs" / "own_model" / "fused_model.msgpack")
  assert "CIFAR-10 skipped: TRAIN_CIFAR is False" in _text(cifar)
  out = _text(resume)
  assert "notebook_command" not in out and "resumed from" in out and "final evaluation at step 6" in out
  assert os.path.isfile(tmp_path / "runs" / "digits" / "fused_model.msgpack")

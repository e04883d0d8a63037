"""CI is chosen by marks, not by test ids or file lists: every test carries ``core`` (every leg) or ``slow`` (leg 1
only); .ci/run's second leg selects with ``-m "core and not slow"`` over the whole folder and deselects nothing by
name (a renamed test would silently fall out of a list); the marks are registered, so that ``--strict-markers``
rejects a misspelt one; and a test that carries neither fails."""

import configparser
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests import helpers

pytestmark = pytest.mark.slow  # CI: leg 1 only (pytest.ini)


def test_ci_selects_by_marker_not_by_id():
  ci = open(os.path.join(helpers.ROOT, ".ci", "run")).read()
  assert "--deselect" not in ci and " -k " not in ci
  assert re.search(r'-m "core and not slow" tests\n', ci), "leg 2: the whole folder, by marks"


def test_the_marks_are_registered_and_strict():
  ini = configparser.ConfigParser()
  ini.read(os.path.join(helpers.ROOT, "pytest.ini"))
  assert "core:" in ini["pytest"]["markers"] and "slow:" in ini["pytest"]["markers"]
  assert "--strict-markers" in ini["pytest"]["addopts"]


def test_mark_slow_refuses_a_case_it_does_not_find():
  marked = helpers.mark_slow([(1, "a"), (2, "b")], "2-b")
  assert marked[0] == (1, "a") and marked[1].marks[0].name == "slow"
  with pytest.raises(AssertionError, match="not among the cases"):
    helpers.mark_slow([(1, "a")], "1-c")


def test_a_test_with_neither_mark_fails(tmp_path):
  """The suite's conftest and pytest.ini (two xdist workers, as every run of the suite) on a folder of two
  modules: a marked test passes, one that carries neither mark fails, naming itself and the fix."""
  (tmp_path / "tests").mkdir()
  shutil.copy(os.path.join(helpers.ROOT, "tests", "conftest.py"), tmp_path / "tests")
  shutil.copy(os.path.join(helpers.ROOT, "pytest.ini"), tmp_path)
  marked = "import pytest\npytestmark = pytest.mark.core\ndef test_a(): pass\n"
  (tmp_path / "tests" / "test_marked.py").write_text(marked)
  (tmp_path / "tests" / "test_unmarked.py").write_text("def test_b(): pass\n")
  r = subprocess.run(
    [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=tmp_path, capture_output=True, text=True,
    timeout=300,
  )  # fmt: skip
  out = r.stdout + r.stderr
  assert r.returncode == 1 and "1 passed, 1 error" in out, out  # failed in its setup
  assert "tests/test_unmarked.py::test_b carries neither of the marks core nor slow" in out, out

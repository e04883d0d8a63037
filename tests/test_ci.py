"""CI is chosen by markers, not by test ids: .ci/run's second leg selects with ``-m "not first_leg_only"`` and
deselects nothing by name (a renamed test would silently fall out of a list of ids), and the marker is
registered, so that ``--strict-markers`` rejects a misspelt one."""

import configparser
import os
import re

from tests import helpers


def test_ci_selects_by_marker_not_by_id():
  ci = open(os.path.join(helpers.ROOT, ".ci", "run")).read()
  assert "--deselect" not in ci and " -k " not in ci
  assert re.search(r'-m "not first_leg_only"', ci)


def test_the_marker_is_registered_and_strict():
  ini = configparser.ConfigParser()
  ini.read(os.path.join(helpers.ROOT, "pytest.ini"))
  assert "first_leg_only:" in ini["pytest"]["markers"]
  assert "--strict-markers" in ini["pytest"]["addopts"]


def test_first_leg_only_refuses_a_case_it_does_not_find():
  import pytest

  marked = helpers.first_leg_only([(1, "a"), (2, "b")], "2-b")
  assert marked[0] == (1, "a") and marked[1].marks[0].name == "first_leg_only"
  with pytest.raises(AssertionError, match="not among the cases"):
    helpers.first_leg_only([(1, "a")], "1-c")

"""docs/CONFIG.md is the schema as text: regenerating it gives the file as committed, and it lists every field
of ``defaults.get_config()`` once, with its default, under the section that sets it."""

import os
import re

from ipf_jax.config import defaults, document
from tests import helpers

PATH = os.path.join(helpers.ROOT, "docs", "CONFIG.md")


def test_config_md_is_not_stale():
  assert open(PATH, encoding="utf-8").read() == document.render(), (
    "docs/CONFIG.md is stale: python -m ipf_jax.config.document > docs/CONFIG.md"
  )


def test_config_md_lists_every_field_once_with_its_default():
  config = defaults.get_config()
  rows = re.findall(r"^\| `(\w+)` \| `(.*?)` \| (.*) \|$", open(PATH, encoding="utf-8").read(), re.M)
  names = [name for name, _, _ in rows]
  assert sorted(names) == sorted(config.keys()), set(names) ^ set(config.keys())
  for name, default, meaning in rows:
    assert default.replace("\\|", "|") == repr(config[name]), name
    assert meaning.strip(), f"{name} has no meaning in defaults.py"


def test_a_continued_comment_is_joined():
  """A comment continued on the lines below its field (defaults.py's layout) reads as one sentence."""
  (row,) = [r for r in document.fields(defaults._run) if r[0] == "checkpoint_every_steps"]
  assert row[1] == "save the whole state every N steps and at the end (0 = only at the end, -1 = never: no resuming)"

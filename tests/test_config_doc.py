"""docs/CONFIG.md is the schema as text: regenerating it gives the file as committed, and it lists every field
of ``defaults.get_config()`` once, with its default, under the section that sets it."""

import json
import os
import re

import pytest

from ipf_jax.config import defaults, document, sync
from ipf_jax.runtime import compatibility
from tests import helpers

pytestmark = pytest.mark.slow  # CI: leg 1 only (pytest.ini)

PATH = os.path.join(helpers.ROOT, "docs", "CONFIG.md")


def test_config_md_is_not_stale():
  assert open(PATH, encoding="utf-8").read() == document.render(), (
    "docs/CONFIG.md is stale: python -m ipf_jax.config.document > docs/CONFIG.md"
  )


def test_config_md_lists_every_field_once_with_its_default():
  config = defaults.get_config()
  rows = re.findall(r"^\| `(\w+)` \| `(.*?)` \| (\w+) \| (.*) \|$", open(PATH, encoding="utf-8").read(), re.M)
  names = [name for name, *_ in rows]
  assert sorted(names) == sorted(config.keys()), set(names) ^ set(config.keys())
  for name, default, _, meaning in rows:
    assert default.replace("\\|", "|") == repr(config[name]), name
    assert meaning.strip(), f"{name} has no meaning in defaults.py"


def test_the_on_resume_column_is_what_a_resume_does():
  """The schema's kinds (``defaults.HOW``, ``IDENTITY``) name real fields, and the resume checks do what the
  column says: a changed *silent* field is not listed, a *refused* one stops the resume naming it, a *listed* one
  is listed."""
  config = defaults.get_config()
  assert set(defaults.HOW) | set(defaults.IDENTITY) <= set(config.keys())
  saved = json.loads(config.to_json())
  rows = re.findall(r"^\| `(\w+)` \| `.*?` \| (\w+) \|", open(PATH, encoding="utf-8").read(), re.M)
  for name, kind in rows:
    changed = dict(saved, **{name: "another value"})
    listed = compatibility.changed_fields(changed, config)
    flips = sync.resolve(changed) != sync.resolve(saved)  # sync="auto" resolves anew: another program, refused
    if kind == "refused" or flips:
      with pytest.raises(compatibility.CheckpointError, match=f"config.{'sync' if flips else name}="):
        compatibility.check_meaning(changed, config, "runs/x")
    else:
      compatibility.check_meaning(changed, config, "runs/x")
    assert bool(listed) == (kind != "silent"), (name, kind, listed)


def test_a_continued_comment_is_joined():
  """A comment continued on the lines below its field (defaults.py's layout) reads as one sentence."""
  (row,) = [r for r in document.fields(defaults._run) if r[0] == "checkpoint_every_steps"]
  assert row[1] == "save the whole state every N steps and at the end (0 = only at the end, -1 = never: no resuming)"

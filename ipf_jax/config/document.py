"""``docs/CONFIG.md``, generated from the schema (``defaults.py``: each section's docstring, each field's default
and its comment), so the reference cannot drift from the code (``tests/test_config_doc.py`` fails when it is
stale).

  python -m ipf_jax.config.document > docs/CONFIG.md
"""

from __future__ import annotations

import ast
import inspect

from ipf_jax.config import defaults

INTRO = """\
# Configuration reference

Generated from `ipf_jax/config/defaults.py` by `python -m ipf_jax.config.document`: do not edit by hand.

Configs are `ml_collections` files (`configs/*.py`, or your own) that start from the defaults below and set a
few fields; any field can be overridden on the command line, `--config.FIELD=VALUE`. A misspelt field is one
error naming the closest one; a value that cannot work stops the run before anything compiles, with one error
naming the field and a value that would work:

```
error: config.global_batch_size: 128 is not divisible by num_particles x data devices = 3 x 8 = 24; use a \
multiple of 24 such as 120
```

"On resume" says what a resume with a changed value does: *refused* for a field deciding what the run is
(`mode`, `num_particles`, `init`, `weigh_on`, `sync`, ...: it stops and names the field), *silent* for how it is
run (logging, saving, devices, extra evaluation sets), *listed* for the others: they continue with the new value
if the saved state fits (more steps, a lower learning rate), and the run's first lines list each change.
`sync="auto"` is compared as what it resolves to: a change of `mode`, `num_particles` or of a field only the
per-step filter has (`elastic_pull`, `resample_every`, `shared_params`, `fsdp`, `compress_correction`, float16)
that moves it between the outer loop and the per-step filter is refused as a change of `sync` (the fields:
`config/sync.py`, `PER_STEP_ONLY` and `PER_STEP_SETTINGS`).
The fields that matter most, with measured advice: README, "The fields that matter".
"""


def fields(section) -> list[tuple[str, str]]:
  """``[(field, comment), ...]`` of one section function, in order; a comment continued on the lines below
  (comment-only lines) joined to it."""
  lines, _ = inspect.getsourcelines(section)
  tree = ast.parse(inspect.getsource(section))
  out = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute):
      row = node.lineno - 1
      comment = [lines[row].split("#", 1)[1].strip()] if "#" in lines[row] else []
      following = row + 1
      while following < len(lines) and lines[following].strip().startswith("#"):
        comment.append(lines[following].strip()[1:].strip())
        following += 1
      out.append((node.targets[0].attr, " ".join(comment)))
  return out


def cell(text: str) -> str:
  return text.replace("|", "\\|")


def render() -> str:
  config = defaults.get_config()
  parts = [INTRO]
  for section in defaults.SECTIONS:
    title, _, rest = inspect.getdoc(section).partition(":")
    rest = rest.strip()
    head = "| field | default | on resume | meaning |\n|---|---|---|---|"
    parts.append(f"## {title}\n\n{rest[:1].upper() + rest[1:]}\n\n{head}")
    parts[-1] += "".join(
      f"\n| `{name}` | `{cell(repr(config[name]))}` | {defaults.on_resume(name)} | {cell(comment)} |"
      for name, comment in fields(section)
    )
  return "\n\n".join(parts) + "\n"


def main() -> None:
  print(render(), end="")


if __name__ == "__main__":
  main()

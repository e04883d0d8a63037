"""docs/DESIGN.md is the design the code cites: every ``DESIGN.md §N`` / ``DESIGN.md "Name"`` reference in the
code, tests, configs, examples and docs resolves to one of its headings (and every ``BENCHMARKS.md "Name"``
to one of BENCHMARKS.md's or its history's), and its layout names every module."""

import json
import os
import re

import pytest

pytestmark = pytest.mark.slow  # CI: leg 1 only (pytest.ini)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = {"DESIGN.md": os.path.join(ROOT, "docs", "DESIGN.md"), "BENCHMARKS.md": os.path.join(ROOT, "BENCHMARKS.md")}
# DESIGN.md §3.5 | DESIGN.md "Durability" | (`BENCHMARKS.md`, "Scaling")
REFERENCE = re.compile(r'\b(DESIGN|BENCHMARKS)\.md`?,?\s*(?:§(\d+(?:\.\d+)*)(?!\.?\d)|"([^"\n]+)")')


def headings(text: str) -> tuple[set, set]:
  """``({"3", "3.5", ...}, {"State", "Durability", ...})``: the numbers of a document's headings and their
  names (without the number, up to a ``:``, ``;`` or `` (``), outside code blocks."""
  numbers, names, fenced = set(), set(), False
  for line in text.splitlines():
    if line.startswith("```"):
      fenced = not fenced
    m = None if fenced else re.match(r"#{2,4} (.*)", line)
    if m:
      text = m.group(1).strip()
      number = re.match(r"(\d+(?:\.\d+)*)\.?\s+", text)
      if number:
        numbers.add(number.group(1))
        text = text[number.end() :]
      names.add(re.split(r":|;| \(", text)[0].strip())
  return numbers, names


def sources() -> dict:
  """``{relative path: text}`` of the project's own files that may cite the documents (notebook cells'
  sources as text)."""
  out = {}
  for top in (
    "ipf_jax",
    "tests",
    "benchmarks",
    "configs",
    "examples",
    "docs",
    "README.md",
    "CONTRIBUTING.md",
    "BENCHMARKS.md",
    "train.py",
  ):
    path = os.path.join(ROOT, top)
    files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for f in files:
      rel = os.path.relpath(f, ROOT)
      if f.endswith((".py", ".md")) and os.path.abspath(f) != os.path.abspath(__file__):
        out[rel] = open(f, encoding="utf-8").read()
      elif f.endswith(".ipynb"):
        out[rel] = "\n".join("".join(c["source"]) for c in json.load(open(f, encoding="utf-8"))["cells"])
  return out


def unresolved(texts: dict, documents: dict) -> tuple[list, int]:
  """``(missing, found)``: the ``(file, document, reference)`` of ``texts`` that no heading of ``documents``
  (``{"DESIGN.md": its text, ...}``) has, and how many references there were."""
  parsed = {name: headings(text) for name, text in documents.items()}
  missing, found = [], 0
  for path, text in texts.items():
    for m in REFERENCE.finditer(text):
      doc, number, name = m.group(1) + ".md", m.group(2), m.group(3)
      if path == os.path.relpath(DOCS[doc], ROOT) and number:
        continue  # a document's own numbers are its structure, not references to itself
      found += 1
      numbers, names = parsed[doc]
      if not (number in numbers if number else name in names):
        missing.append((path, doc, number or name))
  return missing, found


HISTORY = os.path.join(ROOT, "docs", "benchmarks", "HISTORY.md")


def documents() -> dict:
  """The documents' texts; a BENCHMARKS.md heading may also be one of its history's (docs/benchmarks/)."""
  texts = {name: open(path, encoding="utf-8").read() for name, path in DOCS.items()}
  texts["BENCHMARKS.md"] += "\n" + open(HISTORY, encoding="utf-8").read()
  return texts


def test_every_design_and_benchmarks_reference_resolves_to_a_heading():
  missing, found = unresolved(sources(), documents())
  assert found >= 40, found  # the references this test exists for are found at all
  assert not missing, f"references to headings the documents do not have: {missing}"


def test_a_reference_to_a_missing_heading_is_found():
  docs = {
    "DESIGN.md": "## 3. One step\n### 3.5 Resampling\n## 7. Durability: promises\n```\n## 9. Fenced\n```\n",
    "BENCHMARKS.md": "## Scaling: the exchange\n",
  }
  texts = {
    "a.py": 'DESIGN.md §3.5. DESIGN.md "Durability" (`BENCHMARKS.md`, "Scaling") DESIGN.md §3',
    "b.py": 'DESIGN.md §3.5.9 and DESIGN.md §4, DESIGN.md "Dur", DESIGN.md §9, BENCHMARKS.md "Scal"',
  }
  missing, found = unresolved(texts, docs)
  assert found == 9
  assert missing == [
    ("b.py", "DESIGN.md", "3.5.9"),
    ("b.py", "DESIGN.md", "4"),
    ("b.py", "DESIGN.md", "Dur"),
    ("b.py", "DESIGN.md", "9"),
    ("b.py", "BENCHMARKS.md", "Scal"),
  ]


def test_the_layout_names_every_module():
  text = documents()["DESIGN.md"]
  layout = text[text.index("## 9. Layout") : text.index("## 10.")]
  modules = sorted(
    f[:-3] for f in os.listdir(os.path.join(ROOT, "ipf_jax")) if f.endswith(".py") and f != "__init__.py"
  )
  missing = [m for m in modules if not re.search(rf"\b{m}\.py\b", layout)]
  assert not missing, f"docs/DESIGN.md's layout does not name: {missing}"

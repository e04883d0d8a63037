"""docs/DESIGN.md is the design the code cites: every ``DESIGN.md §N`` / ``DESIGN.md "Name"`` reference in the
code, tests, configs and docs resolves to one of its headings, and its layout names every module."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DESIGN = os.path.join(ROOT, "docs", "DESIGN.md")
REFERENCE = re.compile(r'DESIGN\.md(?:`)?\s*(?:§(\d+(?:\.\d+)?)|"([^"\n]+)")')


def headings() -> tuple[set, list]:
  """``({"3", "3.5", ...}, ["State", ...])``: the numbers and the texts (without their numbers) of the
  document's headings."""
  numbers, texts = set(), []
  for line in open(DESIGN, encoding="utf-8"):
    m = re.match(r"#{2,4} (.*)", line)
    if m:
      text = m.group(1).strip()
      number = re.match(r"(\d+(?:\.\d+)?)\.?\s+", text)
      if number:
        numbers.add(number.group(1))
        text = text[number.end():]
      texts.append(text)
  return numbers, texts


def cited() -> list[tuple[str, str]]:
  """``(file, reference)`` for every design reference in the project's own files."""
  out = []
  for top in ("ipf_jax", "tests", "benchmarks", "configs", "docs", "README.md", "BENCHMARKS.md", "train.py"):
    path = os.path.join(ROOT, top)
    files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for f in files:
      if f.endswith((".py", ".md")) and os.path.abspath(f) not in (DESIGN, os.path.abspath(__file__)):
        for m in REFERENCE.finditer(open(f, encoding="utf-8").read()):
          out.append((os.path.relpath(f, ROOT), m.group(1) or m.group(2)))
  return out


def test_every_design_reference_resolves_to_a_heading():
  numbers, texts = headings()
  refs = cited()
  assert len(refs) >= 20, refs  # the references this test exists for are found at all
  missing = [(f, r) for f, r in refs
             if not (r in numbers if re.fullmatch(r"\d+(\.\d+)?", r) else any(t.startswith(r) for t in texts))]
  assert not missing, f"references to headings docs/DESIGN.md does not have: {missing}"


def test_the_reference_pattern_tells_a_missing_heading():
  numbers, texts = headings()
  assert {"1", "2", "3", "3.3", "3.4", "3.5", "6"} <= numbers
  assert "9.9" not in numbers and not any(t.startswith("Nowhere") for t in texts)
  m = REFERENCE.search('see DESIGN.md §3.5 and DESIGN.md "Durability"')
  assert m.group(1) == "3.5"
  assert REFERENCE.findall('DESIGN.md "Durability"') == [("", "Durability")]


def test_the_layout_names_every_module():
  text = open(DESIGN, encoding="utf-8").read()
  layout = text[text.index("## 9. Layout"):]
  modules = sorted(f[:-3] for f in os.listdir(os.path.join(ROOT, "ipf_jax"))
                   if f.endswith(".py") and f != "__init__.py")
  missing = [m for m in modules if not re.search(rf"\b{m}\.py\b", layout)]
  assert not missing, f"docs/DESIGN.md's layout does not name: {missing}"

"""What is alive at a compiled program's memory peak, read from XLA's dump: which buffers set the peak.

  XLA_FLAGS=--xla_dump_to=/tmp/dump python my_program.py
  python -m benchmarks.peak_live /tmp/dump [--module module_0008.jit_call] [--top 12]

``memory_analysis()`` gives a compiled program's peak as one number; XLA's own dump says which values make it:
``*-live-range.txt`` lists every buffer live at the peak instruction ("Live ranges at T (peak)") with its size,
and the optimized HLO (``*after_optimizations.txt``) gives each one's shape and the JAX operation it came from
(``metadata={op_name=...}``). ``live_at_peak`` joins the two; ``by_shape`` groups them (count and MiB per shape,
largest first, with one operation that made such a buffer), the table ``fsdp_memory --blocks --live`` prints.
By default the largest program in the dump is read (a train step outweighs the small helper programs JAX
compiles beside it). A benchmark tool, not a test: its own test compiles a program whose peak it knows.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*(?P<shape>\(.*?\)|\S+)\s+[\w\-]+\(")
_LIVE = re.compile(r"^\s+(?P<name>[^\s{]+)\{(?P<index>[\d,]*)\}: (?P<bytes>\d+) bytes")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_STAGE = re.compile(r"\.(?:sm_[\d.]+_)?\w*after_optimizations$")


def _tuple_elements(shape: str) -> list[str]:
  """The top-level elements of a tuple shape ``(f32[2], (s32[], f32[3]))``."""
  inner, parts, depth, start = shape[1:-1], [], 0, 0
  for i, c in enumerate(inner):
    depth += c in "([{"
    depth -= c in ")]}"
    if c == "," and depth == 0:
      parts.append(inner[start:i].strip())
      start = i + 1
  return parts + [inner[start:].strip()]


def _shape_at(shape: str, index: str) -> str:
  for i in [int(x) for x in index.split(",") if x]:
    if not shape.startswith("("):
      break
    elements = _tuple_elements(shape)
    shape = elements[i] if i < len(elements) else shape
  return re.sub(r"\{[^}]*\}", "", shape)  # layouts off: f32[8,197]{1,0} -> f32[8,197]


def _strip_comments(shape: str) -> str:
  """A long tuple's shape carries ``/*index=5*/`` comments between its elements."""
  return re.sub(r"/\*.*?\*/", "", shape)


def modules(dump_dir: str) -> dict[str, str]:
  """``module_NNNN.name`` -> the prefix of its files, for each program in ``dump_dir`` with a live range.

  Keyed by XLA's numbered name, not the function's: two programs of one name (two compiles of ``jit_step``)
  are two entries.
  """
  found = {}
  for path in glob.glob(os.path.join(dump_dir, "*-live-range.txt")):
    prefix = path[: -len("-live-range.txt")]  # .../module_0042.jit_step.cpu_after_optimizations
    name = _STAGE.sub("", os.path.basename(prefix))  # a GPU's stage holds dots: .sm_9.0_gpu_after_optimizations
    found[name] = prefix
  return found


def find_module(dump_dir: str, name: str) -> str:
  """The file prefix of ``name``: a numbered name (``module_0042.jit_step``), or a function's name when only one
  program in the dump has it."""
  found = modules(dump_dir)
  if name in found:
    return found[name]
  matches = [k for k in found if k.split(".", 1)[1] == name]
  if len(matches) == 1:
    return found[matches[0]]
  listing = ", ".join(sorted(found)) or "none"
  if matches:
    raise KeyError(f"{len(matches)} programs in {dump_dir} are named {name!r}: give one of {', '.join(matches)}")
  raise KeyError(f"no program {name!r} in {dump_dir}; it has: {listing}")


def largest_module(dump_dir: str, exclude: set[str] = frozenset()) -> str:
  """The file prefix of the program with the largest optimized HLO in ``dump_dir``, skipping the prefixes in
  ``exclude``."""
  prefixes = [p for p in modules(dump_dir).values() if p not in exclude]
  if not prefixes:
    raise FileNotFoundError(
      f"no new *-live-range.txt in {dump_dir}: run the program with "
      "XLA_FLAGS=--xla_dump_to=DIR (an XLA that writes no *-live-range.txt cannot be read)"
    )
  return max(prefixes, key=lambda p: os.path.getsize(p + ".txt"))


def live_at_peak(prefix: str) -> tuple[int, list[dict]]:
  """(bytes live at the peak instruction, those buffers): each a dict of name, bytes, shape and the JAX ``op``.

  The bytes are the sum of the listed buffers, the live set XLA's heap simulator reports; ``memory_analysis()``'s
  peak also counts the arguments and outputs, so it can be larger.
  """
  with open(prefix + ".txt") as f:
    hlo = {}
    for line in f:
      m = _INSTRUCTION.match(line)
      if m:
        op = _OP_NAME.search(line)
        hlo[m["name"]] = (_strip_comments(m["shape"]), op[1] if op else "")
  rows, at_peak = [], False
  with open(prefix + "-live-range.txt") as f:
    for line in f:
      if line.strip().startswith("Live ranges at") and "(peak)" in line:
        at_peak = True
        continue
      m = _LIVE.match(line) if at_peak else None
      if at_peak and not m:
        break  # the peak's list ends where the stack-trace breakdown begins
      if m:
        shape, op = hlo.get(m["name"], ("?", ""))
        rows.append(dict(name=m["name"], bytes=int(m["bytes"]), shape=_shape_at(shape, m["index"]), op=op))
  if not at_peak:
    raise ValueError(f"{prefix}-live-range.txt has no 'Live ranges at ... (peak)' section")
  return sum(r["bytes"] for r in rows), rows


def by_shape(rows: list[dict]) -> list[dict]:
  """The live buffers grouped by shape, largest total first: shape, count, MiB, and one op that made one."""
  groups = collections.defaultdict(list)
  for r in rows:
    groups[r["shape"]].append(r)
  out = [
    dict(shape=s, count=len(g), mib=sum(r["bytes"] for r in g) / 2**20, op=max(g, key=lambda r: len(r["op"]))["op"])
    for s, g in groups.items()
  ]
  return sorted(out, key=lambda g: -g["mib"])


def print_groups(live: int, buffers: int, groups: list[dict], top: int) -> None:
  """The top ``top`` groups, under a line of all ``buffers`` live (``live`` bytes)."""
  print(f"live at the peak: {live / 2**20:,.0f} MiB in {buffers} buffers")
  print("| shape | buffers | MiB | an op that made one |")
  print("|---|---|---|---|")
  for g in groups[:top]:
    op = g["op"] if len(g["op"]) <= 90 else "…" + g["op"][-89:]
    print(f"| {g['shape']} | {g['count']} | {g['mib']:,.0f} | {op} |")


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("dump_dir")
  parser.add_argument(
    "--module", default="", help="module_0042.jit_step, or jit_step when only one has that name; default: the largest"
  )
  parser.add_argument("--top", type=int, default=12)
  args = parser.parse_args()
  try:
    prefix = find_module(args.dump_dir, args.module) if args.module else largest_module(args.dump_dir)
  except (KeyError, FileNotFoundError) as e:
    parser.error(str(e.args[0]))
  live, rows = live_at_peak(prefix)
  print(os.path.basename(prefix))
  print_groups(live, len(rows), by_shape(rows), args.top)


if __name__ == "__main__":
  main()

"""The package's layers (CONTRIBUTING.md "Code map", docs/DESIGN.md §9): a module imports only from its own subpackage
and from the layers below it, so each layer can be read, and tested, without those above it."""

import ast
import importlib
import os
import pkgutil

import pytest

import ipf_jax

pytestmark = pytest.mark.core  # CI: every leg (pytest.ini)

ROOT = os.path.dirname(ipf_jax.__file__)
# Bottom to top. Subpackages on one rank do not import each other.
LAYERS = (
  ("errors", "files"),
  ("population", "evaluation", "data", "models"),
  ("spmd",),
  ("config",),
  ("reporting",),
  ("runtime",),
  ("compare",),  # python -m ipf_jax.compare: the command, above everything
)
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def unit(module: str) -> str:
  """``ipf_jax.spmd.step`` -> ``spmd``; the package itself -> ``""`` (the public names: above every layer)."""
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else ""


def imports(path: str, module: str):
  """The ``ipf_jax`` modules that the file imports, at its top or inside a function."""
  package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
  for node in ast.walk(ast.parse(open(path).read())):
    if isinstance(node, ast.Import):
      yield from (a.name for a in node.names if a.name.startswith("ipf_jax"))
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
      if base == "ipf_jax":
        yield from (f"ipf_jax.{a.name}" for a in node.names)
      elif base.startswith("ipf_jax"):
        yield base


def modules():
  for info in pkgutil.walk_packages([ROOT], "ipf_jax."):
    spec = importlib.util.find_spec(info.name)
    yield info.name, spec.origin
  yield "ipf_jax", os.path.join(ROOT, "__init__.py")


def test_every_module_is_in_a_layer():
  units = {unit(name) for name, _ in modules()} - {""}
  assert units == set(RANK), f"add {units - set(RANK)} to LAYERS (or remove {set(RANK) - units})"


def test_imports_point_down_only():
  upward = []
  for name, path in modules():
    here = unit(name)
    for target in imports(path, name):
      there = unit(target)
      if here == "" or there == here:
        continue
      if there == "" or RANK[there] >= RANK[here]:
        upward.append(
          f"{name} imports {target} ({here}: rank {RANK[here]}, {there or 'ipf_jax'}: rank {RANK.get(there, 'top')})"
        )
  assert not upward, "\n".join(upward)


def test_each_subpackage_says_what_its_layer_is():
  for names in LAYERS:
    for name in names:
      module = importlib.import_module(f"ipf_jax.{name}")
      if hasattr(module, "__path__"):  # a subpackage (errors and files are single modules)
        assert module.__doc__ and len(module.__doc__.split()) >= 40, f"ipf_jax.{name}: its docstring is its contract"


def test_the_checker_sees_an_upward_import(tmp_path):
  """The check itself: an import of the run-time from the population maths is reported, a relative one too."""
  bad = tmp_path / "bad.py"
  bad.write_text("from ipf_jax.runtime import trainer\nfrom ..spmd import step\n")
  found = list(imports(str(bad), "ipf_jax.population.bad"))
  assert found == ["ipf_jax.runtime", "ipf_jax.spmd"], found


def test_no_function_is_longer_than_a_screen():
  """A function of ``ipf_jax`` reads on one screen: at most 60 lines, docstring included."""
  long = []
  for name, path in modules():
    for node in ast.walk(ast.parse(open(path).read())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
        long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
  assert not long, long


def config_readers(path: str) -> list:
  """Where a file imports ``ml_collections`` or has a function with a parameter named ``config`` or ``cfg``."""
  found = []
  for node in ast.walk(ast.parse(open(path).read())):
    if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "ml_collections" for a in node.names):
      found.append(f"line {node.lineno}: imports ml_collections")
    elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ml_collections":
      found.append(f"line {node.lineno}: imports from ml_collections")
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
      args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
      name = getattr(node, "name", "lambda")
      found += [f"line {node.lineno}: {name}({a.arg})" for a in args if a.arg in ("config", "cfg")]
  return found


def test_below_the_config_layer_nothing_reads_a_config():
  """The config is read in one place (``ipf_jax.config.read`` and the builder, DESIGN.md §9): the layers below
  ``config`` take typed arguments (a ``ParticleSpec``, a ``ModelSpec``, an optax transformation, numbers), never
  the config, so its schema is no hidden dependency of theirs."""
  readers = []
  for name, path in modules():
    here = unit(name)
    if here and RANK[here] < RANK["config"]:
      readers += [f"{name} {where}" for where in config_readers(path)]
  assert not readers, "\n".join(readers)


def test_the_config_reader_check_sees_a_reader(tmp_path):
  bad = tmp_path / "bad.py"
  bad.write_text("import ml_collections\ndef f(x, config):\n  return config.seed\ng = lambda cfg: cfg\n")
  assert config_readers(str(bad)) == [
    "line 1: imports ml_collections",
    "line 2: f(config)",
    "line 4: lambda(cfg)",
  ]

"""Every command the README shows, run as a new user would type it (tests read README.md, so a command
that stops working, or a new one nobody checked, fails here).

In the README's order, from a fresh directory holding the checkout's ``configs/`` and an empty ``runs/``:
- ``python train.py ...``: train.py's own flag parser (``cli.parse_flags`` on fresh flags), then every check
  a run makes before training (``--dry_run``: config, devices, data, workdir; nothing compiled). A workdir
  that a later command reads (``--eval_only``, ``python -m ipf_jax.reporting``, ``tensorboard``) is trained for
  real, for a few steps. Commands with the placeholder ``/path/to/tfds`` must fail only on the unprepared TFDS data.
- The Modes table: each row's flags as a ``python train.py`` command (default config).
- ``python -m ipf_jax.reporting``: run; ``tensorboard --logdir``: the run's event files exist;
  ``examples/*.py``: their argument parsers take the flags (tests/test_examples.py runs them);
  ``python -m pydoc``/``benchmarks.*``: the module imports; ``pip install -r FILE``: the file exists;
  ``python -m pytest ...``: the command ``.ci/run`` runs.
- Fashion-MNIST: ``apt-get install``: the package is installed (what ``.ci/run`` does);
  ``python -m ipf_jax.data.prepare``: run, into the test's prepared folder (``tests/test_fashion_mnist.py``)
  instead of the user's ``~/tensorflow_datasets``, which the config's dry run then reads.
"""

import ast
import contextlib
import importlib
import io
import os
import re
import shlex
import subprocess
import sys

import pytest
from absl import flags

from ipf_jax.data.errors import DataError
from ipf_jax.runtime import cli, trainer
from tests import helpers

pytestmark = pytest.mark.slow  # CI: leg 1 only (pytest.ini)

README = os.path.join(helpers.ROOT, "README.md")
# The user's documents, in reading order: the README first, then where it sends its reader.
USER_DOCS = ("README.md", "docs/RUNNING.md", "docs/LIBRARY.md", "docs/EVALUATION.md", "CONTRIBUTING.md")
LIBRARY = os.path.join(helpers.ROOT, "docs", "LIBRARY.md")
sys.path.insert(0, os.path.join(helpers.ROOT, "examples"))
# A real run is short and small: these commands are checked for working, not for how well they train.
REAL_STEPS = ["--config.num_train_steps=4", "--config.log_every_steps=2", "--config.cnn_features=(4,8)"]
PLACEHOLDER = "/path/to/"


def readme_commands(text, name="README"):
  """``(where, tokens)`` of every command of one document: bash blocks (``\\`` joined, ``#`` comments and ``&&``
  split), the README's Modes table's flags and inline spans starting with ``python `` or ``pip ``."""
  found = []
  for block in re.finditer(r"```bash\n(.*?)```", text, re.S):
    for line in block.group(1).replace("\\\n", " ").splitlines():
      tokens = shlex.split(line, comments=True)
      while tokens:
        cut = tokens.index("&&") if "&&" in tokens else len(tokens)
        found.append((f"{name} line {text[: block.start()].count(chr(10)) + 1}", tokens[:cut]))
        tokens = tokens[cut + 1 :]
  if "## Modes" in text:
    modes = text[text.index("## Modes") :]
    for row in modes[modes.index("\n|") + 1 : modes.index("\n\n", modes.index("\n|"))].splitlines()[2:]:
      for span in re.findall(r"`(--config\.[^`]+)`", row.split("|")[2]):
        found.append((f"Modes table, {row.split('|')[1].strip()}", ["python", "train.py", *shlex.split(span)]))
  for span in re.findall(r"`((?:python|pip) [^`]+)`", text):
    found.append((f"{name} inline", shlex.split(span)))
  return found


def user_commands():
  """Every command of the user's documents, in reading order."""
  return [c for doc in USER_DOCS for c in readme_commands(open(os.path.join(helpers.ROOT, doc)).read(), doc)]


def train_flags(tokens):
  fv = flags.FlagValues()
  argv = ["train.py", *tokens[2:]]
  cli.define_flags(fv, argv)
  cli.parse_flags(argv, fv)
  return fv


def run_train_command(tokens, real: bool, small: bool):
  """``real``: train (``REAL_STEPS``); ``small``: a dry run on a workdir trained for real (its smaller CNN)."""
  fv = train_flags(tokens + (REAL_STEPS if real else REAL_STEPS[-1:] if small else []))
  if real:
    return trainer.train_and_evaluate(fv.config, cli.workdir_of(fv))
  try:
    return trainer.check_run(fv.config, cli.workdir_of(fv), eval_only=fv.eval_only)
  except DataError as e:
    assert any(PLACEHOLDER in t for t in tokens), f"{' '.join(tokens)}: {e}"
    assert "is not prepared" in str(e) and "tfds build" in str(e), str(e)
    return str(e)


def _workdir(tokens):
  if tokens[:2] == ["python", "train.py"]:
    return cli.workdir_of(train_flags(tokens))
  reads = (
    tokens[:3] == ["python", "-m", "ipf_jax.reporting"] and len(tokens) > 3 or tokens[:2] == ["tensorboard", "--logdir"]
  )
  return tokens[-1] if reads else None


def library_commands(text):
  """The lines of the bash blocks of docs/LIBRARY.md's "Use it as a library" section, as a user would paste them."""
  section = text[text.index("## Use it as a library") :]
  section = section[: section.index("\n## ")]
  return [
    line
    for block in re.findall(r"```bash\n(.*?)```", section, re.S)
    for line in block.replace("\\\n", " ").splitlines()
    if line.strip()
  ]


def test_library_commands_run_verbatim_in_a_fresh_environment(tmp_path):
  """docs/LIBRARY.md's library commands, pasted into a shell in a fresh virtualenv in a copy of the checkout (pip
  offline: the dependencies are this environment's, see ``helpers.venv_env``): the install first, then each
  example as written. The one with the placeholder data path must stop on the missing data alone."""
  commands = library_commands(open(LIBRARY).read())
  assert commands[0].split("#")[0].split() == ["pip", "install", "-e", "."], commands
  src = helpers.copy_checkout(tmp_path / "checkout")
  env = helpers.venv_env(helpers.fresh_venv(tmp_path / "venv"))
  for line in commands:
    r = subprocess.run(["bash", "-c", line], cwd=src, env=env, capture_output=True, text=True, timeout=600)
    if PLACEHOLDER in line:
      assert r.returncode != 0 and "ucf101" in r.stderr and "Traceback" not in r.stderr, (line, r.stderr[-3000:])
    else:
      assert r.returncode == 0, (line, r.stdout[-2000:], r.stderr[-3000:])
    if "custom_model.py" in line:
      assert "mesh (particle, data)=(4, 1) on 4 cpu device(s)" in r.stdout, r.stdout  # config.num_cpu_devices
      assert "ensemble accuracy" in r.stdout, r.stdout


def test_library_programs_run_verbatim(tmp_path):
  """docs/LIBRARY.md's two library programs (Linen, then NNX with AdamW), pasted one after the other into a fresh
  Python process (the package importable, as after the install line; nothing forced)."""
  section = open(LIBRARY).read()
  section = section[section.index("## Use it as a library") :]
  programs = re.findall(r"```python\n(.*?)```", section[: section.index("\n## ")], re.S)
  assert len(programs) == 2 and "nnx.Module" in programs[1], programs
  check = (
    "\nassert probs.shape == (397, 10) and isinstance(module, nnx.Module), probs.shape\n"
    "print('ok', results['ensemble']['accuracy'])\n"
  )
  env = dict(os.environ, PYTHONPATH=helpers.ROOT, JAX_PLATFORMS="cpu")
  (tmp_path / "runs").mkdir()  # as in the checkout
  r = subprocess.run(
    [sys.executable, "-c", programs[0] + programs[1] + check],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
  assert r.stdout.count("on 4 cpu device(s)") == 2, r.stdout
  accuracy = float(r.stdout.split("\nok ")[1].split()[0])
  assert accuracy > 0.8, r.stdout[-2000:]


def test_readme_claims_the_example_length():
  lines = len(open(os.path.join(helpers.ROOT, "examples", "custom_model.py")).read().splitlines())
  assert int(re.search(r"`examples/custom_model.py`, (\d+) lines", open(LIBRARY).read()).group(1)) == lines
  assert int(re.search(r"the whole program, (\d+) lines", open(README).read()).group(1)) == lines


def with_fashion_dir(tokens, fashion_dir):
  """The user's TFDS folder in a command replaced by the test's (Fashion-MNIST prepared there)."""
  if tokens[:2] == ["python", "train.py"] and "configs/fashion_mnist" in " ".join(tokens):
    return tokens + [f"--config.data_dir={fashion_dir}"]
  if tokens[:3] == ["python", "-m", "ipf_jax.data.prepare"]:
    return [fashion_dir if t.startswith("~/") else t for t in tokens]
  return tokens


def test_every_readme_command_works_as_written(tmp_path, monkeypatch, fashion_dir):
  commands = [(where, with_fashion_dir(tokens, fashion_dir)) for where, tokens in user_commands()]
  assert len(commands) >= 15, commands
  monkeypatch.chdir(tmp_path)
  os.symlink(os.path.join(helpers.ROOT, "configs"), "configs")
  os.mkdir("runs")  # as in the checkout
  readers = set()
  for _, tokens in commands:  # workdirs that a later command reads are trained for real
    if tokens[:2] != ["python", "train.py"] or "--eval_only" in tokens:
      readers.add(_workdir(tokens))
    readers.update(t.split("=", 1)[1] for t in tokens if t.startswith("--config.init_from="))
  trained, seen = set(), []
  for where, tokens in commands:
    what = f"{where}: {' '.join(tokens)}"
    seen.append(what)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      if tokens[:2] == ["python", "train.py"]:
        workdir = _workdir(tokens)
        real = workdir in readers and workdir not in trained and "--eval_only" not in tokens
        starts_from_trained = any(t.split("=", 1)[1] in trained for t in tokens if t.startswith("--config.init_from="))
        result = run_train_command(tokens, real, workdir in trained or starts_from_trained)
        if real:
          trained.add(workdir)
          assert 0 <= result["ensemble"]["accuracy"] <= 1, what  # 4 steps: it ran, not how well
        else:
          assert result.startswith("dry run") or PLACEHOLDER in " ".join(tokens), (what, result)
      elif tokens[:3] == ["python", "-m", "ipf_jax.reporting"] and len(tokens) > 3:
        from ipf_jax.reporting import report

        assert tokens[3] in trained, what
        report.main(tokens[3:])
        assert os.path.isfile(os.path.join(tokens[3], "report", "weights.png")), what
      elif tokens[:2] == ["tensorboard", "--logdir"]:
        assert any(f.startswith("events.out.tfevents") for f in os.listdir(tokens[2])), what
      elif tokens[:3] == ["python", "-m", "ipf_jax.data.prepare"]:
        from ipf_jax.data import prepare

        assert prepare.main(tokens[3:]) == 0, what
        assert "already prepared" in out.getvalue(), what  # the test's folder: prepared by the fixture
      elif tokens[0] == "apt-get":  # what it installs is there (.ci/run runs it)
        from ipf_jax.data import prepare

        if tokens[1] == "install":
          assert [t for t in tokens[2:] if not t.startswith("-")] == ["dataset-fashion-mnist"], what
          assert prepare.read_fashion_mnist(prepare.DEBIAN_SOURCE["fashion_mnist"]), what
        else:
          assert tokens[1:] == ["update"], what
      elif tokens[:3] == ["python", "-m", "ipf_jax.compare"]:  # as typed, checked by its own --dry_run
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=helpers.ROOT)
        r = subprocess.run(
          [sys.executable, *tokens[1:], "--dry_run"], env=env, capture_output=True, text=True, timeout=600
        )
        assert r.returncode == 0 and "Nothing was written" in r.stdout, (what, r.stdout[-2000:], r.stderr[-2000:])
      elif tokens[:2] == ["python", "-m"] and tokens[2] == "pytest":
        ci = open(os.path.join(helpers.ROOT, ".ci", "run")).read()
        assert " ".join(tokens) in ci, f"{what} is not what .ci/run runs"
      elif tokens[:2] == ["python", "-m"]:
        module = importlib.import_module(tokens[-1] if tokens[2] == "pydoc" else tokens[2])
        if tokens[2] == "pydoc":
          import pydoc

          assert "train_and_evaluate" in pydoc.render_doc(module), what
        else:
          assert callable(getattr(module, "main", None)), what
      elif tokens[0] == "python" and tokens[1].startswith("examples/"):
        module = importlib.import_module(os.path.basename(tokens[1])[:-3])
        args = module.parse_args(tokens[2:])
        assert args.workdir == tokens[tokens.index("--workdir") + 1], what
      elif tokens[:2] == ["pip", "install"]:
        for i, t in enumerate(tokens):
          if t == "-r":
            assert os.path.isfile(os.path.join(helpers.ROOT, tokens[i + 1])), what
        assert "-r" in tokens or tokens[2] in (".", "-e"), what
      else:
        pytest.fail(f"{what}: this test does not know how to run it; teach tests/test_readme.py")
  assert readers <= trained | {None}, (readers, trained)
  assert any("Modes table, DDP" in s and "mode=ddp" in s for s in seen), seen


def test_license_and_citation_agree_with_the_package():
  """LICENSE is the Apache-2.0 text pyproject.toml names; CITATION.cff cites the package's version."""
  import tomllib

  project = tomllib.load(open(os.path.join(helpers.ROOT, "pyproject.toml"), "rb"))["project"]
  assert project["license"] == {"text": "Apache-2.0"}
  text = open(os.path.join(helpers.ROOT, "LICENSE")).read()
  assert "Apache License" in text.splitlines()[1] and "Version 2.0, January 2004" in text
  assert "END OF TERMS AND CONDITIONS" in text
  citation = open(os.path.join(helpers.ROOT, "CITATION.cff")).read()
  assert re.search(rf"^version: {re.escape(project['version'])}$", citation, re.M)
  assert re.search(r"^license: Apache-2.0$", citation, re.M)


def test_job_scripts_parse_as_train_py_commands():
  """docs/RUNNING.md's job scripts (``sh`` blocks: SLURM, TPU pods, Kubernetes; no cluster here to run them):
  each ``python train.py`` in them is a command train.py's own parser takes, its config loaded."""
  text = open(os.path.join(helpers.ROOT, "docs", "RUNNING.md")).read()
  lines = [
    line[line.index("python train.py") :].rstrip('"')
    for block in re.findall(r"```sh\n(.*?)```", text, re.S)
    for line in block.replace("\\\n", " ").splitlines()
    if "python train.py" in line
  ]
  assert len(lines) == 3, lines
  for line in lines:
    tokens = [t.replace("$JOB_COMPLETION_INDEX", "0") for t in shlex.split(line)]
    fv = train_flags(tokens)
    assert fv.config.dataset == "imagenet2012" and fv.workdir.startswith(("/shared/", "/mnt/")), line


def test_the_user_documents_stay_short_and_speak_to_users():
  """The README is read in ten minutes (at most 250 lines), BENCHMARKS.md is for readers (at most 900 lines,
  its history in docs/benchmarks/), and neither talks about the project's issues."""
  readme = open(README).read()
  benchmarks = open(os.path.join(helpers.ROOT, "BENCHMARKS.md")).read()
  assert readme.count("\n") <= 250 and benchmarks.count("\n") <= 900
  for text in (readme, benchmarks):
    assert "(issue:" not in text and 'issue "' not in text
  for doc in USER_DOCS[1:] + ("docs/CONFIG.md", "docs/benchmarks/HISTORY.md", "LICENSE", "CITATION.cff"):
    assert os.path.isfile(os.path.join(helpers.ROOT, doc)), doc
    assert doc.split("/")[-1] in readme or doc == "docs/benchmarks/HISTORY.md", f"the README links {doc}"


def test_references_to_the_user_documents_name_their_sections():
  """``README "Name"`` / ``README, "Name"`` and ``RUNNING.md "Name"`` in the code, configs, benchmarks and docs
  name a heading those documents have (the README was rewritten once: a stale hint sends users nowhere)."""
  pattern = re.compile(r'\b(README|RUNNING\.md)(?:\.md)?`?,?\s*"([^"\n]+)"')
  heads = {
    name: {re.split(r":|;| \(", h)[0].strip() for h in re.findall(r"^#{2,4} (.*)$", open(path).read(), re.M)}
    for name, path in (("README", README), ("RUNNING.md", os.path.join(helpers.ROOT, "docs", "RUNNING.md")))
  }
  found, missing = 0, []
  for top in ("ipf_jax", "configs", "benchmarks", "examples", "docs", "CONTRIBUTING.md", "train.py"):
    path = os.path.join(helpers.ROOT, top)
    paths = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for f in paths:
      if f.endswith((".py", ".md")) and not f.endswith("HISTORY.md"):  # the history quotes the README as it was
        for m in pattern.finditer(open(f, encoding="utf-8").read()):
          found += 1
          if m.group(2) not in heads[m.group(1)]:
            missing.append((os.path.relpath(f, helpers.ROOT), m.group(1), m.group(2)))
  assert found >= 5 and not missing, (found, missing)


def test_the_quickstart_then_each_help_example_plans_its_own_run(tmp_path, monkeypatch):
  """After the README's quickstart (trained for real, a few steps), each ``python train.py`` example that
  ``train.py --help`` prints, as printed, through train.py's flag parser and the checks a run makes (a dry run:
  each would train the whole job): every one plans a new run from step 0 in the workdir its comment names, none
  resumes the quickstart's or another mode's run (the mode-change trap)."""
  monkeypatch.chdir(tmp_path)
  os.symlink(os.path.join(helpers.ROOT, "configs"), "configs")
  os.mkdir("runs")
  quickstart = "python train.py --config configs/digits.py --workdir runs/digits"
  assert quickstart in open(README).read()
  with contextlib.redirect_stdout(io.StringIO()):
    run_train_command(shlex.split(quickstart), real=True, small=False)
  shown = ast.get_docstring(ast.parse(open(os.path.join(helpers.ROOT, "train.py")).read()))  # what --help prints
  examples = re.findall(r"^\s*(python train\.py [^#\n]*?)\s+# .*?into (runs/\S+)$", shown, re.M)
  assert {w for _, w in examples} == {"runs/digits_ipf_qsr", "runs/digits_ddp", "runs/digits_ensemble"}, examples
  for command, workdir in examples:
    fv = train_flags(shlex.split(command))
    assert cli.workdir_of(fv) == workdir, command
    with contextlib.redirect_stdout(io.StringIO()):
      plan = trainer.check_run(fv.config, workdir)
    assert "from the start" in plan, (command, plan)

"""The ``train.py`` / ``ipf-train`` command: flags -> ``trainer.train_and_evaluate``.

  ipf-train --config configs/digits.py                 # == python train.py ...; into runs/digits_ipf_qsr
  ipf-train --config configs/digits.py --config.mode=ddp   # plain DDP, into runs/digits_ddp

Without ``--workdir`` a run's folder is named after its config file and mode (and the outer loop's ``sync``
when it has one): ``runs/<config>_<mode>[_<sync>]``, so runs of different modes never share one.

Exit codes: 0 finished; 1 error (one line "error: ..."); 2 bad command line;
69 a peer process did not start or was lost; 75 stopped at
config.time_limit_minutes; 130 stopped by SIGINT; 143 stopped by SIGTERM or a
preemption notice (in a multi-process run, any signal: every process stops at
the step JAX's preemption sync point names). After 75, 130 and 143 a checkpoint is saved: rerun the same
command to resume.
"""

import difflib
import logging
import os
import re
import sys

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from ipf_jax.config import sync as sync_lib
from ipf_jax.config import validation
from ipf_jax.data.errors import DataError
from ipf_jax.runtime import checkpoint, cluster, preemption, rewind, trainer, workdir

FLAGS = flags.FLAGS


def define_flags(flag_values: flags.FlagValues, argv=None) -> None:
  """The command's flags on ``flag_values`` (``FLAGS``; tests parse README commands on fresh ones)."""
  f = dict(flag_values=flag_values)
  flags.DEFINE_string(
    "workdir",
    "",
    "Directory for checkpoints, logs, config and results; an existing one is resumed. Default: "
    "runs/<config file's name>_<mode>[_<sync>] (e.g. runs/digits_ipf_qsr, runs/digits_ddp).",
    **f,
  )
  flags.DEFINE_bool(
    "eval_only",
    False,
    "Evaluate the newest checkpoint in --workdir and print the table; no "
    "training. Writes eval_results.step<N>.json beside the run's results and changes nothing else.",
    **f,
  )
  flags.DEFINE_bool(
    "dry_run",
    False,
    "Check the config, devices, data and --workdir as a run would, print what it "
    "would do (train, resume at step N, only evaluate) and exit: nothing is compiled or written.",
    **f,
  )
  flags.DEFINE_string(
    "coordinator_address",
    None,
    "Multi-host: HOST:PORT of process 0 (jax.distributed). Without "
    "it, jax.distributed.initialize() detects SLURM, Open MPI, Cloud TPU pods, GKE, ... by itself.",
    **f,
  )
  flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes (with --coordinator_address).", **f)
  flags.DEFINE_integer("process_id", None, "Multi-host: this process's index (with --coordinator_address).", **f)
  flags.DEFINE_integer(
    "startup_timeout",
    300,
    "Multi-host: seconds to wait for every process to connect before stopping with an error naming the coordinator.",
    **f,
  )
  flags.DEFINE_integer(
    "peer_timeout",
    60,
    "Multi-host: a process that has not answered for this many seconds is "
    "lost; the others stop with an error naming it.",
    **f,
  )
  # ml_collections already applies the --config.FIELD overrides of sys.argv to the default file here.
  try:
    config_flags.DEFINE_config_file(
      "config",
      default_config_path(),
      "Training configuration file (a checkout's configs/*.py, or your own).",
      lock_config=True,
      sys_argv=argv,
      **f,
    )
  except Exception as e:  # noqa: BLE001
    _config_error(e, argv or sys.argv)


def apply_mode(config, argv) -> None:
  """``--config.mode=ddp`` on the command line trains one model: it implies ``num_particles=1`` unless the
  command line sets ``num_particles`` too (then the config check decides)."""
  given = {_field(a) for a in argv[1:] if a.startswith("--config.")}
  if config.mode == "ddp" and "mode" in given and "num_particles" not in given and config.num_particles != 1:
    print(f"mode=ddp trains one model: num_particles=1 (the config's {config.num_particles} is for ensemble and ipf)")
    config.num_particles = 1


ERRORS = (
  validation.ConfigError,
  checkpoint.CheckpointError,
  trainer.NonFiniteError,
  rewind.DivergedError,
  workdir.WorkdirError,
  DataError,
)


def _usage_error(message: str) -> None:
  print(f"error: {message}", file=sys.stderr)
  sys.exit(preemption.EXIT_USAGE)


def _config_file_error(argv) -> None:
  """One line for a ``--config`` file that does not exist: its path and the configs beside it."""
  path = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"), None)
  path = path or next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
  if path is None or os.path.isfile(path.split(":")[0]):
    return
  folder = os.path.dirname(path) or "."
  there = (
    sorted(f for f in os.listdir(folder) if f.endswith(".py") and not f.startswith("_"))
    if os.path.isdir(folder)
    else []
  )
  hint = f"the configs in {folder}/: {', '.join(there)}" if there else f"{folder}/ holds no config (*.py)"
  _usage_error(f"--config {path}: no such file; {hint}")


def _config_error(error: Exception, argv) -> None:
  """One line for an unknown field or malformed value in a ``--config...`` argument; exit code 2."""
  _config_file_error(argv)
  overrides = [a for a in argv[1:] if a.startswith("--config")]
  culprit = next(
    (a for a in overrides if a.startswith("--config.") and re.search(rf"\b{re.escape(_field(a))}\b", str(error))), None
  )
  if culprit is None:
    _usage_error(f"{' '.join(overrides) or 'the command line'}: {' '.join(str(error).split())[:300]}")
  from ipf_jax.config import defaults

  known = list(defaults.get_config().keys())
  if _field(culprit) in known:
    _usage_error(f"{culprit}: {' '.join(str(error).split())[:300]}")
  close = difflib.get_close_matches(_field(culprit), known, n=1)
  hint = f"did you mean --config.{close[0]}?" if close else "ipf_jax/config/defaults.py lists every field"
  _usage_error(f"{culprit}: the config has no field {_field(culprit)!r}; {hint}")


def _field(arg: str) -> str:
  return arg[len("--config.") :].split("=")[0].split(".")[0]


def default_workdir(config, config_path: str) -> str:
  """``runs/<config file's stem>_<mode>`` (``_<sync>`` added for the outer loop, ``sync="auto"`` as it resolves:
  ``runs/digits_ipf_qsr``): a run's default folder, so that two commands that differ in what they train never
  resume each other's run (and a per-step run saved before ``auto`` was the default resumes with
  ``--config.sync=step``)."""
  stem = os.path.splitext(os.path.basename(config_path or "config"))[0]
  sync = sync_lib.resolve(config)
  return os.path.join("runs", f"{stem}_{config.mode}" + (f"_{sync}" if sync != "step" else ""))


def workdir_of(flag_values: flags.FlagValues = FLAGS) -> str:
  """``--workdir``, or ``default_workdir`` of the parsed config (its ``runs/`` created in the current folder)."""
  if flag_values.workdir:
    return flag_values.workdir
  path = default_workdir(flag_values.config, config_flags.get_config_filename(flag_values["config"]))
  os.makedirs(os.path.dirname(path), exist_ok=True)
  return path


def default_config_path() -> str:
  """This package's ``configs/digits.py``: the checkout's beside ``ipf_jax/`` (``python train.py``), else
  the copy installed with the package as ``ipf_jax.configs`` (``ipf-train``); never another directory's."""
  import importlib.util

  package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # ipf_jax/, above runtime/
  checkout = os.path.join(os.path.dirname(package), "configs", "digits.py")
  if os.path.isfile(checkout):
    return os.path.relpath(checkout) if not os.path.relpath(checkout).startswith("..") else checkout
  spec = importlib.util.find_spec("ipf_jax.configs")
  return os.path.join(list(spec.submodule_search_locations)[0], "digits.py") if spec else checkout


define_flags(FLAGS)


def parse_flags(argv, flag_values: flags.FlagValues = FLAGS):
  """absl flag parsing with one line (exit code 2) for an unknown flag or a bad ``--config...`` value;
  then the mode's implied particle count (``apply_mode``)."""
  try:
    rest = flag_values(argv)
    flag_values.config.keys()  # ml_collections reports a config file that failed to load on first access
    apply_mode(flag_values.config, argv)
    return rest
  except flags.Error as e:
    _usage_error(f"{e}. See --helpfull.")
  except Exception as e:  # noqa: BLE001 - ml_collections raises plain errors for --config.FIELD overrides
    _config_error(e, argv)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  absl_logging.set_verbosity(absl_logging.WARNING)  # library chatter (orbax, XLA) off; progress is ours
  # Failures reach the user as one line each; orbax's and asyncio's own tracebacks of them would bury it.
  for name in ("absl", "asyncio"):
    logging.getLogger(name).setLevel(logging.CRITICAL)
  validation.setup_devices(FLAGS.config)  # before jax.distributed starts the backend
  watch = cluster.start(
    FLAGS.coordinator_address,
    FLAGS.num_processes,
    FLAGS.process_id,
    startup_timeout=FLAGS.startup_timeout,
    peer_timeout=FLAGS.peer_timeout,
  )
  error, workdir_path = None, workdir_of()
  try:
    if FLAGS.dry_run:
      print(trainer.check_run(FLAGS.config, workdir_path, eval_only=FLAGS.eval_only))
    elif FLAGS.eval_only:
      trainer.evaluate_checkpoint(FLAGS.config, workdir_path)
    else:
      trainer.train_and_evaluate(FLAGS.config, workdir_path)
  except ERRORS as e:
    error = str(e)
    print(f"error: {e}", file=sys.stderr)
    return preemption.EXIT_ERROR
  except preemption.RunStopped as e:
    return e.exit_code
  except KeyboardInterrupt:
    error = "interrupted"
    print("interrupted: stopped at once; nothing saved since the newest checkpoint", file=sys.stderr)
    return preemption.EXIT_SIGINT
  except Exception as e:  # noqa: BLE001
    if watch is None:
      raise  # one process: a bug shows its traceback
    watch.fail(e)  # several: one line, the peers told, no wait in JAX's exit barrier
  finally:
    if watch is not None:
      watch.finish(error)
  return 0


def print_help() -> None:
  """``--help``: the command's use and the flags that matter (absl's ``--helpfull`` lists all of them)."""
  print((sys.modules["__main__"].__doc__ or __doc__).strip() + "\n")
  print(FLAGS.module_help(sys.modules[__name__]))
  print("\n  --config.FIELD=VALUE: any field of ipf_jax/config/defaults.py (e.g. --config.mode=ensemble)")


def run(argv=None):
  """The ``train.py`` / ``ipf-train`` command: parse flags, run, exit with the documented code."""
  if any(a in ("--help", "-h", "--helpshort", "-?") for a in (argv or sys.argv)[1:]):
    print_help()
    sys.exit(0)
  app.run(lambda a: sys.exit(main(a)), argv=argv, flags_parser=parse_flags)

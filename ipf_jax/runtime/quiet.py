"""orbax's leftovers after a failure the run reports in one line, dropped where they arise and nowhere else.

When a background save fails (a full disk) or a restore stops on a damaged
file, TensorStore's threads still hold callbacks for orbax's asyncio event
loop, which is closed by then: each raises ``RuntimeError('Event loop is
closed')`` inside ``loop.call_soon_threadsafe``, and Python reports each through
``sys.unraisablehook`` (no object, one traceback apiece: 17 to 120 of them
measured for one failed save of the digits model). While an orbax operation
is in flight (``arm``, from a save's start until it is committed; a restore)
and, once one has failed (``after_orbax_failure``), for the rest of the
process, a hook drops exactly those, and unfinished coroutines of orbax's or
TensorStore's own files, and hands every other unraisable exception to the
hook that was there before; ``disarm`` puts that one back. Nothing else is
ever touched (``sys.stderr``, warnings, logging), and nothing waits for the
leftovers to finish.
"""

from __future__ import annotations

import importlib.util
import os
import sys


def _package_dirs() -> tuple[str, ...]:
  """The folders of orbax.checkpoint's and tensorstore's installed files."""
  dirs = []
  for name in ("orbax.checkpoint", "tensorstore"):
    try:
      spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
      continue
    if spec is not None:
      dirs += [os.path.join(d, "") for d in (spec.submodule_search_locations or [])]
  return tuple(dirs)


def is_orbax_leftover(unraisable, package_dirs: tuple[str, ...] = ()) -> bool:
  """``sys.unraisablehook``'s argument is a failed orbax operation's leftover: ``call_soon_threadsafe`` on
  asyncio's closed loop (asyncio's ``_check_closed`` raising), or a coroutine defined in one of
  ``package_dirs`` (orbax's, TensorStore's) collected unfinished."""
  obj, exc = unraisable.object, unraisable.exc_value
  code = getattr(obj, "cr_code", None)  # a coroutine
  if code is not None:
    return bool(package_dirs) and (code.co_filename or "").startswith(package_dirs)
  if obj is not None or not isinstance(exc, RuntimeError) or str(exc) != "Event loop is closed":
    return False
  tb, frames = unraisable.exc_traceback, []
  while tb is not None:
    frames.append((tb.tb_frame.f_code.co_filename, tb.tb_frame.f_code.co_name))
    tb = tb.tb_next
  return any(
    f.endswith(("asyncio/base_events.py", "asyncio\\base_events.py")) and name == "call_soon_threadsafe"
    for f, name in frames
  )


class _Hook:
  """``sys.unraisablehook`` that drops orbax's leftovers and passes the rest to ``previous``."""

  def __init__(self, previous):
    self.previous = previous
    self.package_dirs = _package_dirs()
    self.dropped = 0
    self.failed = False

  def __call__(self, unraisable):
    if is_orbax_leftover(unraisable, self.package_dirs):
      self.dropped += 1
      return
    self.previous(unraisable)


def arm() -> _Hook:
  """An orbax operation starts: installs the hook unless it is there (a hook someone installs later wraps or
  replaces it, as they choose); returns it (``dropped`` counts what it dropped)."""
  hook = sys.unraisablehook
  if not isinstance(hook, _Hook):
    hook = _Hook(hook)
    sys.unraisablehook = hook
  return hook


def disarm() -> None:
  """The operation ended well: the hook that was there before is back, unless one failed (its leftovers
  may come at any time after) or someone has installed another hook since."""
  hook = sys.unraisablehook
  if isinstance(hook, _Hook) and not hook.failed:
    sys.unraisablehook = hook.previous


def after_orbax_failure() -> _Hook:
  """An orbax save or restore has failed: the hook stays for the rest of the process."""
  hook = arm()
  hook.failed = True
  return hook

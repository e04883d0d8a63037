"""orbax's leftovers after a failure the run reports in one line, dropped where they arise and nowhere else.

When a background save fails (a full disk) or a restore stops on a damaged
file, TensorStore's threads still hold callbacks for orbax's asyncio event
loop, which is closed by then: each raises ``RuntimeError('Event loop is
closed')`` inside ``loop.call_soon_threadsafe``, and Python reports each through
``sys.unraisablehook`` (no object, one traceback apiece: 17 to 116 of them
measured for one failed save of the digits model). ``drop_orbax_leftovers``
installs a hook that drops exactly those, and unfinished coroutines of orbax
or TensorStore collected after such a failure, and hands every other
unraisable exception to the hook that was there before. Nothing else is
touched: ``sys.stderr``, warnings and logging stay as they are, and nothing
waits for the leftovers to finish.
"""
from __future__ import annotations

import sys

_SOURCES = ("orbax", "tensorstore")


def is_orbax_leftover(unraisable) -> bool:
  """``sys.unraisablehook``'s argument is a failed orbax operation's leftover: ``call_soon_threadsafe`` on
  asyncio's closed loop (asyncio's ``_check_closed`` raising), or an orbax/TensorStore coroutine
  collected unfinished."""
  obj, exc = unraisable.object, unraisable.exc_value
  code = getattr(obj, "cr_code", None)  # a coroutine
  if code is not None:
    return any(s in (code.co_filename or "") for s in _SOURCES)
  if obj is not None or not isinstance(exc, RuntimeError) or str(exc) != "Event loop is closed":
    return False
  tb, frames = unraisable.exc_traceback, []
  while tb is not None:
    frames.append((tb.tb_frame.f_code.co_filename, tb.tb_frame.f_code.co_name))
    tb = tb.tb_next
  return any(f.endswith(("asyncio/base_events.py", "asyncio\\base_events.py")) and name == "call_soon_threadsafe"
             for f, name in frames)


class _Hook:
  """``sys.unraisablehook`` that drops orbax's leftovers and passes the rest to ``previous``."""

  def __init__(self, previous):
    self.previous = previous
    self.dropped = 0

  def __call__(self, unraisable):
    if is_orbax_leftover(unraisable):
      self.dropped += 1
      return
    self.previous(unraisable)


def drop_orbax_leftovers() -> _Hook:
  """Installs the hook (once per process: a hook someone installs later wraps it or replaces it, as
  they choose); returns it (``dropped`` counts what it dropped)."""
  hook = sys.unraisablehook
  if not isinstance(hook, _Hook):
    hook = _Hook(hook)
    sys.unraisablehook = hook
  return hook

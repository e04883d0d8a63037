"""quiet.py drops orbax's leftovers after a failure and nothing else: the hook that was there gets the rest,
sys.stderr is never replaced, and nothing is installed before a failure."""

import asyncio
import os
import sys
import types

import pytest

from ipf_jax.runtime import quiet

pytestmark = pytest.mark.slow  # CI: leg 1 only (pytest.ini)


def unraisable(exc, obj=None):
  return types.SimpleNamespace(
    exc_type=type(exc), exc_value=exc, exc_traceback=exc.__traceback__, err_msg=None, object=obj
  )


def closed_loop_callback_error():
  """What TensorStore's threads hit after a failed save: call_soon_threadsafe on orbax's closed loop."""
  loop = asyncio.new_event_loop()
  loop.close()
  try:
    loop.call_soon_threadsafe(lambda: None)
  except RuntimeError as e:
    return e
  raise AssertionError("a closed loop accepted a callback")


def test_the_hook_is_there_while_orbax_works_and_for_good_after_it_failed(monkeypatch, tmp_path):
  from ipf_jax.runtime import checkpoint

  def mine(unraisable):
    pass

  monkeypatch.setattr(sys, "unraisablehook", mine)
  checkpoint.Checkpointer(str(tmp_path)).steps()  # no orbax operation: nothing installed
  assert sys.unraisablehook is mine
  hook = quiet.arm()
  assert sys.unraisablehook is hook and hook.previous is mine
  quiet.disarm()  # it went well
  assert sys.unraisablehook is mine
  quiet.arm()
  quiet.after_orbax_failure()
  quiet.disarm()  # leftovers of the failure may still come
  assert isinstance(sys.unraisablehook, quiet._Hook) and sys.unraisablehook.previous is mine


def test_the_closed_loop_leftover_is_dropped_and_everything_else_passes(monkeypatch):
  seen = []
  monkeypatch.setattr(sys, "unraisablehook", seen.append)
  stderr = sys.stderr
  hook = quiet.after_orbax_failure()
  assert sys.unraisablehook is hook and quiet.after_orbax_failure() is hook  # installed once
  leftover = unraisable(closed_loop_callback_error())
  try:
    raise RuntimeError("Event loop is closed")  # same words, raised by someone else's code
  except RuntimeError as e:
    elsewhere = unraisable(e)
  others = [elsewhere, unraisable(ValueError("a user's bug")), unraisable(RuntimeError("x"), obj=object())]
  for u in [leftover, *others]:
    sys.unraisablehook(u)
  assert seen == others and hook.dropped == 1
  assert sys.stderr is stderr


def test_only_coroutines_of_orbax_and_tensorstore_files_are_dropped(monkeypatch):
  import orbax.checkpoint

  seen = []
  monkeypatch.setattr(sys, "unraisablehook", seen.append)
  quiet.after_orbax_failure()

  async def users_own():
    pass

  mine = users_own()
  coroutine_of = lambda f: types.SimpleNamespace(cr_code=types.SimpleNamespace(co_filename=f))  # as the hook sees it
  theirs = coroutine_of(os.path.join(os.path.dirname(orbax.checkpoint.__file__), "_src", "x.py"))
  lookalike = coroutine_of("/home/me/orbax/checkpoint/my_experiment.py")  # a user's folder of the same name
  for obj in (mine, theirs, lookalike):
    sys.unraisablehook(unraisable(RuntimeError("coroutine ignored GeneratorExit"), obj=obj))
  assert [u.object for u in seen] == [mine, lookalike]
  mine.close()

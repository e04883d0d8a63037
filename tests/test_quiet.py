"""quiet.py drops orbax's leftovers after a failure and nothing else: the hook that was there gets the rest,
sys.stderr is never replaced."""
import asyncio
import sys
import types

from ipf_jax import quiet


def unraisable(exc, obj=None):
  return types.SimpleNamespace(exc_type=type(exc), exc_value=exc, exc_traceback=exc.__traceback__, err_msg=None,
                               object=obj)


def closed_loop_callback_error():
  """What TensorStore's threads hit after a failed save: call_soon_threadsafe on orbax's closed loop."""
  loop = asyncio.new_event_loop()
  loop.close()
  try:
    loop.call_soon_threadsafe(lambda: None)
  except RuntimeError as e:
    return e
  raise AssertionError("a closed loop accepted a callback")


def test_the_closed_loop_leftover_is_dropped_and_everything_else_passes(monkeypatch):
  seen = []
  monkeypatch.setattr(sys, "unraisablehook", seen.append)
  stderr = sys.stderr
  hook = quiet.drop_orbax_leftovers()
  assert sys.unraisablehook is hook and quiet.drop_orbax_leftovers() is hook  # installed once
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


def test_only_orbax_and_tensorstore_coroutines_are_dropped(monkeypatch):
  seen = []
  monkeypatch.setattr(sys, "unraisablehook", seen.append)
  quiet.drop_orbax_leftovers()

  async def users_own():
    pass

  mine = users_own()
  # an orbax coroutine, as the hook sees it (its code's file is orbax's)
  theirs = types.SimpleNamespace(cr_code=types.SimpleNamespace(co_filename="/site-packages/orbax/checkpoint/x.py"))
  for obj in (mine, theirs):
    sys.unraisablehook(unraisable(RuntimeError("coroutine ignored GeneratorExit"), obj=obj))
  assert [u.object for u in seen] == [mine]
  mine.close()

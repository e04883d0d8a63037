"""Host batches to global device arrays in the per-particle layout (DESIGN.md §2).

A batch is a dict of arrays with any keys and shapes. Train batches are laid
out ``[P, B, ...]`` and sharded ``P("particle", "data")``: particle ``i``
trains on the ``i``-th of ``P`` equal shards of the global batch, split over
the devices of its group. Eval batches (with a ``mask``) are split over every
device, each process placing only its own part; the eval step gathers them over
``"particle"`` so that every particle sees every example.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Iterator, Optional

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ipf_jax.spmd.mesh import DATA, PARTICLE

TRAIN_BATCH_SPEC = P(PARTICLE, DATA)  # for every array of a train batch
EVAL_BATCH_SPEC = P((PARTICLE, DATA))  # for every array of an eval batch: a different part on each device


def particle_layout(batch: dict, num_particles: int) -> dict:
  """``[G, ...] -> [P, G / P, ...]``: particle ``i`` trains on the ``i``-th shard."""
  return {k: v.reshape((num_particles, v.shape[0] // num_particles) + v.shape[1:]) for k, v in batch.items()}


def put_sharded(batch: dict, spec: P, mesh: jax.sharding.Mesh) -> dict:
  """Global host arrays to global device arrays sharded ``spec``; each process materialises only its own
  shards."""
  return {
    k: jax.make_array_from_callback(v.shape, NamedSharding(mesh, spec), lambda idx, v=v: v[idx])
    for k, v in batch.items()
  }


def _local_block_shape(sharding: NamedSharding, global_shape: tuple[int, ...]) -> tuple[int, ...]:
  """Shape of the part of a global array that this process's devices hold (assumed contiguous)."""
  index = list(sharding.addressable_devices_indices_map(global_shape).values())
  shard = sharding.shard_shape(global_shape)
  return tuple(len({idx[d].start for idx in index}) * shard[d] for d in range(len(global_shape)))


def put_local_train_batch(batch: dict, num_particles: int, mesh: jax.sharding.Mesh) -> dict:
  """This process's examples (``G / process_count`` of them) into its block of the ``[P, B, ...]`` arrays."""
  out = {}
  for k, v in batch.items():
    global_batch = v.shape[0] * jax.process_count()
    global_shape = (num_particles, global_batch // num_particles) + v.shape[1:]
    sharding = NamedSharding(mesh, TRAIN_BATCH_SPEC)
    local = v.reshape(_local_block_shape(sharding, global_shape))
    out[k] = jax.make_array_from_process_local_data(sharding, local, global_shape)
  return out


def put_train_batch(batch: dict, num_particles: int, mesh: jax.sharding.Mesh, process_local: bool = False) -> dict:
  """Global ``[P, B, ...]`` arrays sharded ``P("particle", "data")``, from the whole global
  batch or (``process_local``) from this process's part of it."""
  if process_local:
    return put_local_train_batch(batch, num_particles, mesh)
  return put_sharded(particle_layout(batch, num_particles), TRAIN_BATCH_SPEC, mesh)


def eval_batch_sizes(batch_size: int, mesh: jax.sharding.Mesh, examples: Optional[int] = None) -> tuple[int, int]:
  """``(global, per process)`` eval batch: ``batch_size`` rounded up to a multiple of the device count
  (the evaluation pads and masks), and its share for each process. A set of fewer ``examples`` than
  ``batch_size`` (a shifted or OOD set of ``shift_examples``) is one batch of its own size, rounded up
  likewise, not padded to ``batch_size``."""
  batch_size = min(batch_size, examples) if examples else batch_size
  size = -(-batch_size // mesh.size) * mesh.size
  return size, size // jax.process_count()


def put_eval_batch(batch: dict, mesh: jax.sharding.Mesh, process_local: bool = False) -> dict:
  """Global ``[N, ...]`` arrays split over every device, from the whole batch or (``process_local``)
  from this process's part of it (``N / process_count`` examples: which part is which does not
  matter, the evaluation only sums)."""
  if not process_local:
    return put_sharded(batch, EVAL_BATCH_SPEC, mesh)
  sharding = NamedSharding(mesh, EVAL_BATCH_SPEC)
  return {
    k: jax.make_array_from_process_local_data(sharding, v, (len(v) * jax.process_count(),) + v.shape[1:])
    for k, v in batch.items()
  }


def prefetch(batches: Iterator[dict], put: Callable[[dict], dict], size: int = 2) -> Iterator[dict]:
  """Reads and places the next ``size`` batches on a background thread while the step runs.

  The thread stops when the consumer stops (the generator is closed), closing ``batches`` (a
  generator), and re-raises its errors in the consumer.
  """
  q: queue.Queue = queue.Queue(maxsize=size)
  stop = threading.Event()
  done = object()

  def hand_over(item) -> bool:
    """Puts ``item`` in the queue unless the consumer has stopped; False when it has."""
    while not stop.is_set():
      try:
        q.put(item, timeout=0.1)
        return True
      except queue.Full:
        continue
    return False

  close = getattr(batches, "close", lambda: None)  # the source (a tf.data iterator), released by the worker

  def worker():
    try:
      finished = True
      for b in batches:
        if not hand_over(put(b)):
          finished = False
          break
      close()  # here, not at interpreter shutdown
    except BaseException as e:  # noqa: BLE001 - handed to the consumer
      hand_over(e)
      try:
        close()
      except BaseException:  # noqa: BLE001 - the first error is the one reported
        pass
      return
    if finished:
      hand_over(done)

  thread = threading.Thread(target=worker, name="ipf_jax-prefetch", daemon=True)
  thread.start()
  try:
    while True:
      item = q.get()
      if item is done:
        return
      if isinstance(item, BaseException):
        raise item
      yield item
  finally:
    stop.set()
    thread.join(timeout=10)

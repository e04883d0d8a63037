"""The particle exchanges (``population.exchange``) against ``x[src]`` in numpy, on four meshes; the ragged
exchange's plan against a numpy model of ``ragged_all_to_all`` (XLA:CPU cannot run it) and its lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from ipf_jax.population import exchange as exchange_lib
from ipf_jax.population import particle_filter as pf
from ipf_jax.spmd import mesh as mesh_lib
from tests.helpers import MESH_SHAPES, mark_slow, sharded

pytestmark = pytest.mark.core  # CI: every leg (pytest.ini)


def _exchange_on_mesh(mesh, dp, tree, src, method="all_to_all", bucket_bytes=None):
  specs = jax.tree.map(lambda _: P("particle"), tree)
  if method == "rounds":
    exchange = lambda t, s: exchange_lib.exchange_rounds(t, s, mesh_lib.PARTICLE, dp, bucket_bytes)
  else:
    exchange = lambda t, s: exchange_lib.exchange(t, s, mesh_lib.PARTICLE, dp, method)
  fn = jax.jit(jax.shard_map(exchange, mesh=mesh, in_specs=(specs, P()), out_specs=specs))
  placed = jax.tree.map(lambda x: sharded(mesh, x, P("particle")), tree)
  return jax.device_get(fn(placed, sharded(mesh, jnp.asarray(src, jnp.int32), P())))


@pytest.mark.parametrize(  # ragged: XLA:CPU has no ragged-all-to-all (below)
  "per_device,dp,dd,method",
  mark_slow(
    [(n, *mesh, m) for n in (1, 2, 4) for mesh in MESH_SHAPES for m in ("all_to_all", "rounds")], "4-8-1-rounds"
  ),
)
def test_exchange_moves_exactly_state_at_src(dp, dd, per_device, method):
  p = dp * per_device
  mesh = mesh_lib.make_mesh(p, jax.devices()[: dp * dd], dp)
  rng = np.random.default_rng(100 * dp + per_device)
  tree = {
    "w": rng.normal(size=(p, 3, 2)).astype(np.float32),
    "count": np.arange(p, dtype=np.int32) * 10,
    "nested": (rng.normal(size=(p,)).astype(np.float32), rng.normal(size=(p, 5)).astype(jnp.bfloat16)),
  }
  # What resampling produces (survivors keep their slot): ancestors of every kind, through assign_slots.
  ancestors = [
    np.arange(p),
    np.zeros(p, int),
    np.full(p, p - 1),
    np.sort(rng.integers(0, p, size=p)),
    np.repeat(np.arange(0, p, 2), 2)[:p],
    np.sort(rng.choice(p, size=p) // 3),
  ]
  sources = [np.asarray(pf.assign_slots(jnp.asarray(a))) for a in ancestors]
  if method == "all_to_all":  # takes any source vector, not only resampling's
    sources += [np.arange(p)[::-1], rng.integers(0, p, size=p), rng.permutation(p)]
  # rounds: the default buckets, the float32 leaves in one bucket (one ppermute), each leaf in its own.
  bucket_sizes = [None, 1 << 20, 1] if method == "rounds" else [None]
  for src in sources:
    for bucket_bytes in bucket_sizes:
      out = _exchange_on_mesh(mesh, dp, tree, src, method, bucket_bytes)
      expect = jax.tree.map(lambda x: x[src], tree)
      jax.tree.map(np.testing.assert_array_equal, out, expect)


def test_buckets_group_one_dtype_in_order_up_to_the_limit():
  leaves = [
    np.zeros((2, 4), np.float32),
    np.zeros((2, 3), np.int32),
    np.zeros((2, 2), np.float32),
    np.zeros((2, 10), np.float32),
    np.zeros((2, 1), np.float32),
    np.zeros((2, 2), np.int32),
  ]
  # One particle's bytes: 16, 12, 8, 40, 4, 8.
  assert exchange_lib.buckets(leaves, 24) == [[0, 2], [1, 5], [3], [4]]
  assert exchange_lib.buckets(leaves, 28) == [[0, 2, 4], [1, 5], [3]]  # leaf 3 alone: the float32 bucket stays open
  assert exchange_lib.buckets(leaves, 1 << 20) == [[0, 2, 3, 4], [1, 5]]
  assert exchange_lib.buckets(leaves, 1) == [[0], [1], [2], [3], [4], [5]]


@pytest.mark.parametrize("dp,per_device", [(8, 1), (4, 2), (8, 2)])
def test_rounds_run_only_the_transfers_a_resampling_needs(dp, per_device):
  """The replicated round schedule against a plain loop: round (k, j) is needed when slot j of some
  device d takes a particle from device d - k; replacing K particles needs at most K rounds."""
  p = dp * per_device
  rng = np.random.default_rng(dp)
  for k_replaced in (0, 1, p // 2, p - 1):
    src = np.arange(p)
    slots = rng.choice(p, k_replaced, replace=False)
    src[slots] = rng.integers(0, p, size=k_replaced)
    expect = np.zeros((dp, per_device), bool)
    for n in range(p):
      if src[n] != n:
        expect[(n // per_device - src[n] // per_device) % dp, n % per_device] = True
    got = np.asarray(exchange_lib.active_rounds(jnp.asarray(src), per_device, dp))
    np.testing.assert_array_equal(got, expect)
    assert got[1:].sum() <= k_replaced


def _ragged_all_to_all_in_numpy(operands, plans, num_local):
  """``lax.ragged_all_to_all``'s documented semantics, one device after another (its docstring's pseudo-code):
  device ``d`` sends ``operand[in_off[i] : in_off[i] + size[i]]`` of slice ``i`` to device ``i // L``, which
  writes it at that slice's ``out_off``; each receiver checks that it expected exactly that many rows."""
  out = [x.copy() for x in operands]
  for d, (in_off, send, out_off, _) in enumerate(plans):
    for i in range(len(send)):
      e, j = divmod(i, num_local)
      assert plans[e][3][d * num_local + j] == send[i]  # the receiver's recv_sizes match (the collective's rule)
      out[e][out_off[i] : out_off[i] + send[i]] = operands[d][in_off[i] : in_off[i] + send[i]]
  return out


@pytest.mark.parametrize("dp,per_device", [(8, 1), (4, 2), (2, 4), (1, 8)])
def test_ragged_plan_moves_exactly_state_at_src(dp, per_device):
  """The ragged exchange's plan, executed by a numpy model of the collective, gives ``x[src]`` (XLA:CPU cannot
  run ``ragged-all-to-all``; this checks every offset and size the devices would pass it)."""
  p = dp * per_device
  rng = np.random.default_rng(p + dp)
  x = rng.normal(size=(p, 3)).astype(np.float32)
  for ancestors in (np.arange(p), np.zeros(p, int), np.sort(rng.integers(0, p, size=p)), np.full(p, p - 1)):
    src = np.asarray(pf.assign_slots(jnp.asarray(ancestors)))
    plans = [[np.asarray(a) for a in exchange_lib.ragged_plan(jnp.asarray(src), d, per_device, dp)] for d in range(dp)]
    blocks = _ragged_all_to_all_in_numpy(np.split(x, dp), plans, per_device)
    np.testing.assert_array_equal(np.concatenate(blocks), x[src])
    moved = int(np.sum(src != np.arange(p)))
    assert sum(int(plan[1].sum()) for plan in plans) == moved  # only replaced slots move


def test_ragged_exchange_lowers_to_one_collective_per_leaf():
  """The ragged exchange inside the step's ``shard_map`` lowers (StableHLO) to one ``ragged_all_to_all`` per
  leaf and nothing that grows with the mesh; compiling it needs a GPU or TPU."""
  mesh = mesh_lib.make_mesh(8, jax.devices()[:8], 4)
  tree = {"w": np.zeros((8, 3, 2), np.float32), "b": np.zeros((8, 5), jnp.bfloat16)}
  specs = jax.tree.map(lambda _: P("particle"), tree)
  fn = jax.jit(
    jax.shard_map(
      lambda t, s: exchange_lib.exchange(t, s, mesh_lib.PARTICLE, 4, "ragged"),
      mesh=mesh,
      in_specs=(specs, P()),
      out_specs=specs,
    )
  )
  placed = jax.tree.map(lambda x: sharded(mesh, x, P("particle")), tree)
  text = fn.lower(placed, sharded(mesh, jnp.arange(8, dtype=jnp.int32), P())).as_text()
  assert text.count("ragged_all_to_all") == 2, text
  assert "collective_permute" not in text and "stablehlo.all_to_all" not in text

"""The particle train state (DESIGN.md §1): one pytree of global arrays."""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import flax
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ipf_jax.population import compression
from ipf_jax.spmd import fsdp, pretrained, sharing
from ipf_jax.spmd.mesh import DATA, PARTICLE


@flax.struct.dataclass
class ParticleState:
  """All particles' state. Per-particle leaves have a leading ``[P]`` axis.

  Attributes:
    params: ``[P, ...]`` per-particle model parameters (all but the shared ones).
    batch_stats: ``[P, ...]`` BatchNorm running statistics.
    opt_state: ``[P, ...]`` optimizer state; moves with its particle.
    log_weights: ``[P]`` normalised log importance weights (logsumexp = 0).
    step: scalar int32, the global step.
    rng: replicated PRNG key; step ``k`` uses ``fold_in(rng, k)``.
    num_resamples: scalar int32, resampling events so far.
    num_skipped: scalar int32, steps skipped because no particle was finite.
    shared_params: parameters shared by all particles, stored once (``{}`` without sharing).
    shared_opt_state: their optimizer state.
    residual: ``[P, N]`` error-feedback residuals of the compressed correction (None without).
    dynamic_scale: float16's loss scale, one for all particles (flax ``DynamicScale``; None otherwise).
    num_overflows: scalar int32, float16 steps skipped because a gradient overflowed (None otherwise).
    anchor: the outer loop's anchor ``A`` (DESIGN.md §3b), parameters without the particle axis, replicated:
      the fused model (None with the per-step filter).
    outer_opt_state: the anchor's outer optimizer state (its momentum; None with the per-step filter).
  """

  params: Any
  batch_stats: Any
  opt_state: Any
  log_weights: jax.Array
  step: jax.Array
  rng: jax.Array
  num_resamples: jax.Array
  num_skipped: jax.Array
  shared_params: Any = None
  shared_opt_state: Any = None
  residual: Any = None
  dynamic_scale: Any = None
  num_overflows: Any = None
  anchor: Any = None
  outer_opt_state: Any = None


def state_specs(state: Optional[ParticleState] = None) -> ParticleState:
  """``PartitionSpec`` prefix tree: per-particle leaves over ``"particle"``, the rest replicated. With
  ``state`` (arrays, or inside ``jit`` their types): its parameters' and optimizer state's specs leaf by leaf,
  as their arrays carry them (``config.fsdp``: some over ``"data"`` too)."""
  per = P(PARTICLE)
  specs = ParticleState(
    params=per,
    batch_stats=per,
    opt_state=per,
    log_weights=per,
    residual=per,
    step=P(),
    rng=P(),
    num_resamples=P(),
    num_skipped=P(),
    shared_params=P(),
    shared_opt_state=P(),
    dynamic_scale=P(),
    num_overflows=P(),
    anchor=P(),
    outer_opt_state=P(),
  )
  if state is None:
    return specs
  return specs.replace(params=fsdp.specs_of(state.params), opt_state=fsdp.specs_of(state.opt_state))


def shard_map_on_state(fn: Callable, mesh: jax.sharding.Mesh, in_specs: tuple, out_specs: Callable) -> Callable:
  """``call(state, *args)``: ``fn(dims, state, *args)`` under ``shard_map``, the state's specs read from its
  arrays when traced (``state_specs(state)``: so the layout, ``config.fsdp`` or not, travels with the state and
  its checkpoint), ``dims`` its parameters' (``fsdp.dims_of``), ``in_specs`` the other arguments' and
  ``out_specs(state_specs)`` the outputs'."""

  def call(state: ParticleState, *args):
    specs = state_specs(state)
    local = functools.partial(fn, fsdp.dims_of(specs.params))
    return jax.shard_map(local, mesh=mesh, in_specs=(specs, *in_specs), out_specs=out_specs(specs))(state, *args)

  return call


def state_shardings(
  mesh: jax.sharding.Mesh, state_shape: ParticleState, fsdp_min_bytes: Optional[float] = None
) -> ParticleState:
  """A ``NamedSharding`` for every leaf of ``state_shape``; with ``fsdp_min_bytes``, the parameters of at least
  that many bytes per particle sharded over ``"data"`` too (``fsdp.leaf_dim``), and the optimizer state as its
  parameters (``fsdp.like_params``)."""
  specs = state_specs()
  if fsdp_min_bytes is not None:
    params = fsdp.tree_specs(state_shape.params, mesh.shape[DATA], fsdp_min_bytes)
    shapes = [tuple(x.shape) for x in jax.tree.leaves(state_shape.params)]
    pairs = list(zip(jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, P)), shapes))
    specs = specs.replace(params=params, opt_state=fsdp.like_params(state_shape.opt_state, pairs))
  return jax.tree.map(
    lambda spec, sub: jax.tree.map(lambda _: NamedSharding(mesh, spec), sub),
    specs,
    state_shape,
    is_leaf=lambda x: isinstance(x, P),
  )


def one_example(example: dict) -> dict:
  """``example``'s per-example shapes as a batch of one (``ShapeDtypeStruct``s): what ``task.init`` reads."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct((1,) + tuple(x.shape[1:]), x.dtype), example)


def variables_shapes(task, example: dict) -> dict:
  """The shapes of one particle's ``task.init`` variables (nothing compiled)."""
  return jax.eval_shape(lambda: task.init(jax.random.PRNGKey(0), one_example(example)))


def _init_fn(
  rng: jax.Array,
  task,
  tx: optax.GradientTransformation,
  example: dict,
  num_particles: int,
  shared_init: bool = False,
  shared_pattern: str = "",
  compress: bool = False,
  dynamic_scale=None,
  outer_tx: Optional[optax.GradientTransformation] = None,
):
  """``init() -> ParticleState`` (unsharded); see ``train_state_init`` for the arguments."""
  init_rng, run_rng = jax.random.split(rng)
  example = one_example(example)

  def init_one(key, start):
    variables = task.init(key, example)
    if start:  # config.init_from: every particle from the loaded values, but for those left fresh
      variables = pretrained.place(variables, start)
    params, shared = sharing.split(variables["params"], shared_pattern)
    return params, shared, variables.get("batch_stats", {}), tx.init(params)

  def init_all(start=None):
    keys = jax.vmap(lambda i: jax.random.fold_in(init_rng, i))(jnp.arange(num_particles) * (not shared_init))
    params, shared, batch_stats, opt_state = jax.vmap(init_one, in_axes=(0, None))(keys, start)
    shared = jax.tree.map(lambda x: x[0], shared)
    residual = None  # orbax cannot save zero-size arrays: no leaf at all without compression
    if compress:
      size = compression.residual_size(sum(x[0].size for x in jax.tree.leaves(params)))
      residual = jnp.zeros((num_particles, size), jnp.float32)
    anchor = None if outer_tx is None else jax.tree.map(lambda x: jnp.mean(x, axis=0), params)
    return ParticleState(
      anchor=anchor,
      outer_opt_state=None if outer_tx is None else outer_tx.init(anchor),
      params=params,
      batch_stats=batch_stats,
      opt_state=opt_state,
      residual=residual,
      shared_params=shared,
      shared_opt_state=tx.init(shared),
      log_weights=jnp.full((num_particles,), -jnp.log(num_particles), jnp.float32),
      step=jnp.zeros((), jnp.int32),
      rng=run_rng,
      num_resamples=jnp.zeros((), jnp.int32),
      num_skipped=jnp.zeros((), jnp.int32),
      dynamic_scale=dynamic_scale,
      num_overflows=None if dynamic_scale is None else jnp.zeros((), jnp.int32),
    )

  return init_all


def train_state_init(
  rng: jax.Array,
  task,
  tx: optax.GradientTransformation,
  example: dict,
  num_particles: int,
  mesh: jax.sharding.Mesh,
  shared_init: bool = False,
  shared_pattern: str = "",
  compress: bool = False,
  dynamic_scale=None,
  fsdp_min_bytes: Optional[float] = None,
  outer_tx: Optional[optax.GradientTransformation] = None,
):
  """The sharded abstract state (for restoring) and a jitted function that initialises it.

  Args:
    rng: PRNG key; particle ``i`` is initialised from ``fold_in(split(rng)[0], i)``,
      or every particle from ``fold_in(split(rng)[0], 0)`` with ``shared_init``.
    task: the ``Task`` whose model is initialised (``task.init``).
    example: a batch dict (arrays or ``ShapeDtypeStruct``s); only its per-example shapes matter.
    shared_init: start all particles from one point (like DDP replicas), so
      that their weighted average (the fused model) is meaningful; otherwise
      independent inits as in a deep ensemble.
    shared_pattern: regex of parameter paths shared by all particles
      (``sharing.split``); they start from particle 0's init.
    compress: allocate error-feedback residuals for the compressed correction.
    dynamic_scale: the initial loss scale for float16 (``optim.create_dynamic_scale``) or None.
    fsdp_min_bytes: shard each particle's parameters and optimizer state over ``"data"`` (``config.fsdp``),
      the leaves of at least this many bytes per particle; None: every particle whole on each device of its group.
    outer_tx: the outer loop's anchor optimizer (``population.outer.outer_optimizer``): the state then holds the
      anchor, started at the particles' mean, and its optimizer state; None: the per-step filter has neither.
  Returns:
    ``(abstract_state, init)``: ``ShapeDtypeStruct`` leaves carrying their
    ``NamedSharding`` on ``mesh``, and ``init(start=None) -> ParticleState``; ``start``
    (``pretrained.for_model``) replaces the loaded leaves of every particle's init.
  """
  init_all = _init_fn(
    rng, task, tx, example, num_particles, shared_init, shared_pattern, compress, dynamic_scale, outer_tx
  )
  shape = jax.eval_shape(init_all)
  shardings = state_shardings(mesh, shape, fsdp_min_bytes)
  abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shape, shardings)
  return abstract, jax.jit(init_all, out_shardings=shardings)


def train_state_shapes(task, tx: optax.GradientTransformation, example: dict, num_particles: int, **init) -> Any:
  """Shapes and dtypes (``ShapeDtypeStruct`` leaves) of the state ``train_state_init`` builds with the same
  arguments (``init``: its keywords, ``fsdp_min_bytes`` aside); compiles nothing."""
  return jax.eval_shape(_init_fn(jax.random.PRNGKey(0), task, tx, example, num_particles, **init))

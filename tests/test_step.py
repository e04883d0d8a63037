"""The SPMD train step against the plain reference (tests/reference.py) on several meshes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import helpers
from tests.reference import Reference

pytestmark = pytest.mark.core  # CI: every leg (pytest.ini)

# (Dp, Dd) meshes of the 8 fake devices, with L = 1, 2, 4 particles per device.
MESHES = [(8, 1), (4, 2), (1, 8)]
# Each mesh with two particle counts per device, each count on two meshes.
CASES = [(dp, dd, dp * n) for (dp, dd), ns in zip(MESHES, ((1, 2), (2, 4), (1, 4))) for n in ns]


def run_both(config, dp, dd, num_steps, poison=None, edit=None, minimum_scale=None, make_step=None):
  """Runs ``num_steps`` of the SPMD step and of the reference from the same initial state.

  ``poison``: NaN in that particle's parameters; ``edit(host_state)``: any other change to the
  initial state, in both implementations; ``minimum_scale``: float16's lowest loss scale; ``make_step(setup)``:
  the SPMD step to run instead of the config's.
  """
  s = helpers.Setup(config, dp, dd)
  if make_step is not None:
    step = make_step(s)
    s.train_step = lambda state, batch: jax.block_until_ready(step(state, batch))
  if minimum_scale is not None:
    s.state = s.state.replace(dynamic_scale=s.state.dynamic_scale.replace(minimum_scale=minimum_scale))
  init = s.host_state()
  if poison is not None:
    jax.tree.leaves(init.params)[0][poison] = np.nan
  if edit is not None:
    edit(init)
  s.state = jax.device_put(init, jax.tree.map(lambda x: x.sharding, s.state))
  ds = init.dynamic_scale
  scaling = (
    {}
    if ds is None
    else {"loss_scale": float(ds.scale), "growth_interval": ds.growth_interval, "minimum_scale": ds.minimum_scale}
  )
  ref = Reference(
    s.plain_model,
    s.tx,
    s.spec,
    init.params,
    init.batch_stats,
    init.opt_state,
    init.log_weights,
    init.rng,
    shared=init.shared_params,
    shared_opt_state=init.shared_opt_state,
    shared_pattern=config.shared_params,
    lr_fn=s.parts.lr_fn,
    mixup=config.mixup,
    particle_devices=dp,
    **scaling,
  )
  spmd_records, ref_records = [], []
  for images, labels in helpers.particle_batches(config.num_particles, num_steps):
    s.state, m = s.train_step(s.state, s.put(images, labels))
    spmd_records.append(jax.device_get(m))
    ref_records.append(ref.train_step(images, labels))
  return s, ref, spmd_records, ref_records


def assert_same_run(s, ref, spmd_records, ref_records, rtol=2e-4, atol=2e-5, outliers=0.0, outlier_atol=0.0):
  """The records and the final states agree (``outliers``, ``outlier_atol``: ``helpers.assert_close``;
  float16: ``FP16_TOL``)."""
  for k, (m, r) in enumerate(zip(spmd_records, ref_records)):
    np.testing.assert_allclose(m["loss"], r["loss"], rtol=rtol / 2, atol=atol / 2, err_msg=f"loss at step {k}")
    if "loss_scale" in r:
      assert float(m["loss_scale"]) == r["loss_scale"], f"loss scale at step {k}"
      assert bool(m["overflow"]) == r["overflow"], f"overflow at step {k}"
    np.testing.assert_array_equal(m["alive"], r["alive"], err_msg=f"alive at step {k}")
    assert bool(m["resampled"]) == r["resampled"], f"resampling decision at step {k}"
    np.testing.assert_array_equal(m["ancestors"], r["ancestors"], err_msg=f"ancestors at step {k}")
    if "ess" in r:
      np.testing.assert_allclose(m["ess"], r["ess"], rtol=1e-4, err_msg=f"ESS at step {k}")
  final = s.host_state()
  params, batch_stats, opt_state = ref.stacked()
  close = lambda a, b: helpers.assert_close(a, b, rtol=rtol, atol=atol, outliers=outliers, outlier_atol=outlier_atol)
  close(final.params, params)
  close(final.batch_stats, batch_stats)
  close(final.opt_state, opt_state)
  close(final.shared_params, ref.shared)
  np.testing.assert_allclose(final.log_weights, ref.log_w, rtol=rtol / 2, atol=atol / 2)
  assert int(final.num_resamples) == ref.num_resamples
  assert int(final.step) == len(ref_records)
  if ref.loss_scale is not None:
    assert float(final.dynamic_scale.scale) == ref.loss_scale
    assert int(final.dynamic_scale.fin_steps) == ref.finite_steps
    assert int(final.num_overflows) == ref.num_overflows


@pytest.mark.parametrize("dp,dd,p", helpers.mark_slow(CASES, "8-1-16", "4-2-16", "1-8-1"))
def test_ipf_step_matches_reference(dp, dd, p):
  config = helpers.tiny_config(num_particles=p, **helpers.RESAMPLING)
  s, ref, spmd, refr = run_both(config, dp, dd, num_steps=4)
  if p > 1:
    assert sum(r["resampled"] for r in refr) >= 1, "the test must exercise resampling"
  assert_same_run(s, ref, spmd, refr)


def _ascending(src, islands):
  """The ascending rule's ``src`` with the same survivors and copies: in each island, freed slots, ascending,
  take the copies in ancestor order (no island culled)."""
  src = np.array(src)
  for block in np.split(np.arange(len(src)), islands):
    moved = block[src[block] != block]
    src[moved] = np.sort(src[moved])
  return src


# Two islands run 2 steps: at the third, one particle (a jittered copy) sits where its float32 gradient is not
# smooth (the vmapped and the one-at-a-time gradient of the same weights and batch differ by 6e-3 there, measured;
# every other particle by 1e-7), which no placement causes and no tolerance should hide.
@pytest.mark.parametrize("dp,dd,p,islands,steps", [(8, 1, 16, 1, 4), (4, 2, 16, 1, 4), (8, 1, 16, 2, 2)])
def test_local_placement_step_matches_reference(dp, dd, p, islands, steps):
  """``resample_placement="local"``: the step against the reference placing the copies by its own loops
  (``reference.local_slots``) for the mesh's ``Dp`` and ``L``, resampling on most steps with jitter, and at
  least one resampling whose copies sit elsewhere than the ascending rule puts them."""
  config = helpers.tiny_config(num_particles=p, islands=islands, resample_placement="local", **helpers.RESAMPLING)
  s, ref, spmd, refr = run_both(config, dp, dd, num_steps=steps)
  placed = [r["ancestors"] for r in refr if r["resampled"]]
  assert any(not np.array_equal(a, _ascending(a, islands)) for a in placed), "no copy placed off the ascending rule"
  assert_same_run(s, ref, spmd, refr)


@pytest.mark.parametrize("optimizer", ["adamw", "adafactor"])  # lamb and lion: by hand in test_optim
def test_each_optimizer_moves_its_state_with_its_particle(optimizer):
  """config.optimizer's state (Adam's moments in bfloat16, Adafactor's factored second moments) is
  resampled with its particle: the step against the plain-loop reference, which copies each ancestor's
  optimizer state by hand, on a (4, 2) mesh resampling on most steps."""
  config = helpers.tiny_config(
    num_particles=8,
    temperature=4.0,
    forgetting=0.8,
    correction=0.5,
    ess_threshold=0.9,
    optimizer=optimizer,
    base_lr=0.01,
    weight_decay=0.01,
    mu_dtype="bfloat16" if optimizer in ("adamw", "lion") else "",
  )
  s, ref, spmd, refr = run_both(config, 4, 2, num_steps=4)
  assert sum(r["resampled"] for r in refr) >= 1, "the test must exercise resampling"
  assert_same_run(s, ref, spmd, refr, atol=4e-5)
  if config.mu_dtype:
    assert {x.dtype for x in jax.tree.leaves(s.state.opt_state) if x.ndim > 1} >= {jnp.dtype("bfloat16")}


@pytest.mark.parametrize(
  "dp,dd,p,loop",
  helpers.mark_slow(
    [(4, 2, 8, "vmap"), (2, 4, 4, "map"), (8, 1, 16, "unroll"), (4, 2, 16, "map")], "4-2-16-map", "8-1-16-unroll"
  ),
)
def test_scheduled_resampling_matches_reference(dp, dd, p, loop):
  config = helpers.tiny_config(
    num_particles=p, temperature=0.5, correction=1.0, ess_threshold=0.0, resample_every=2, particle_loop=loop
  )
  s, ref, spmd, refr = run_both(config, dp, dd, num_steps=4)
  assert [r["resampled"] for r in refr] == [False, True, False, True]
  # correction=1 with base_lr 0.5 for 4 steps: float32 reduction-order noise reaches ~2e-5 on small weights.
  assert_same_run(s, ref, spmd, refr, atol=4e-5)


@pytest.mark.parametrize(
  "dp,dd,p,islands", helpers.mark_slow([(4, 2, 8, 2), (2, 4, 4, 2), (8, 1, 8, 8)], "8-1-8-8", "2-4-4-2")
)
def test_islands_match_reference(dp, dd, p, islands):
  """islands=G: weights normalised per island, each island resampled within itself; G = P with a culled
  particle: its island (itself) takes the next island's particle. The copies' noise follows the learning rate
  (``jitter_lr``: a traced sigma)."""
  config = helpers.tiny_config(
    num_particles=p,
    islands=islands,
    jitter_lr=0.01,
    **helpers.RESAMPLING,
  )
  s, ref, spmd, refr = run_both(config, dp, dd, num_steps=4, poison=1 if islands == p else None)
  n = p // islands
  moved = 0
  for m in spmd:
    w = np.exp(np.asarray(m["log_weights"], np.float64)).reshape(islands, n).sum(axis=1)
    np.testing.assert_allclose(w[w > 0], 1 / np.sum(w > 0), rtol=1e-5)  # every live island an equal share
    src = np.asarray(m["ancestors"])
    if islands < p:
      np.testing.assert_array_equal(src // n, np.arange(p) // n)  # no copy leaves its island
    moved += int(np.sum(src != np.arange(p)))
  assert moved >= 1, "the test must exercise resampling"
  if islands == p:
    assert spmd[0]["resampled"] and list(spmd[0]["ancestors"]) == [0, 2] + list(range(2, p))
  assert_same_run(s, ref, spmd, refr)


@pytest.mark.parametrize(
  "dp,dd,p,k,loop", helpers.mark_slow([(4, 2, 8, 2, "vmap"), (8, 1, 8, 4, "map")], "8-1-8-4-map")
)
def test_gradient_accumulation_is_one_filter_step_per_update(dp, dd, p, k, loop):
  """grad_accum_steps=k: each step runs k micro-batches (examples m, m + k, ... of a particle's batch) and
  then one reweighing, correction, update, elastic pull and resampling decision; resample_every counts
  updates. Against the reference's loop over micro-batches, on two meshes."""
  config = helpers.tiny_config(
    num_particles=p,
    grad_accum_steps=k,
    temperature=2.0,
    forgetting=0.8,
    correction=0.5,
    elastic_pull=0.2,
    ess_threshold=0.0,
    resample_every=2,
    particle_loop=loop,
  )
  s, ref, spmd, refr = run_both(config, dp, dd, num_steps=4)
  assert [r["resampled"] for r in refr] == [False, True, False, True]
  assert_same_run(s, ref, spmd, refr)
  assert int(s.host_state().step) == 4


@pytest.mark.parametrize(
  "dp,dd,p,alpha,every",
  helpers.mark_slow(
    [(4, 2, 8, 0.2, 1), (8, 1, 16, 0.2, 1), (1, 8, 2, 0.2, 1), (2, 4, 4, 1.0, 1), (4, 2, 8, 0.5, 3)],
    "1-8-2-0.2-1",
    "8-1-16-0.2-1",
  ),
)
def test_elastic_pull_matches_reference(dp, dd, p, alpha, every):
  """The pull after every update, or on every ``every``-th step only (steps 3 of 4 here: PAPA's gentle pull)."""
  config = helpers.tiny_config(
    num_particles=p, temperature=1.0, correction=0.5, elastic_pull=alpha, ess_threshold=0.3, elastic_pull_every=every
  )
  s, ref, spmd, refr = run_both(config, dp, dd, num_steps=4)
  assert_same_run(s, ref, spmd, refr)
  if alpha == 1.0:  # every particle is moved onto the fused parameters (independent inits before)
    for leaf in jax.tree.leaves(s.host_state().params):
      np.testing.assert_allclose(leaf, np.broadcast_to(leaf[0], leaf.shape), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dp,dd,p", [(4, 2, 8), (1, 8, 2)])
def test_shared_parameters_match_reference(dp, dd, p):
  """The first conv and its BatchNorm shared: stored once, consensus-updated, never resampled."""
  config = helpers.tiny_config(
    num_particles=p, temperature=4.0, correction=0.3, ess_threshold=0.9, shared_params="^(Conv_0|BatchNorm_0)/"
  )
  s, ref, spmd, refr = run_both(config, dp, dd, num_steps=4)
  assert sum(r["resampled"] for r in refr) >= 1
  final = s.host_state()
  assert set(final.shared_params) == {"Conv_0", "BatchNorm_0"} and "Conv_0" not in final.params
  assert final.shared_params["Conv_0"]["kernel"].shape == (3, 3, 1, 4), "stored once, no particle axis"
  assert final.params["Conv_1"]["kernel"].shape == (p, 3, 3, 4, 8)
  assert_same_run(s, ref, spmd, refr)


@pytest.mark.parametrize("dp,dd,p", [(4, 2, 8), (8, 1, 8)])
def test_ensemble_mode_is_independent_particles(dp, dd, p):
  config = helpers.tiny_config(num_particles=p, mode="ensemble", temperature=3.0, correction=0.7)
  s, ref, spmd, refr = run_both(config, dp, dd, num_steps=3)
  assert s.spec.temperature == 0 and s.spec.correction == 0 and not s.spec.resampling
  assert_same_run(s, ref, spmd, refr)
  np.testing.assert_allclose(np.exp(s.host_state().log_weights), 1.0 / p, rtol=1e-6)


@pytest.mark.parametrize("dp,dd", [(4, 2), (8, 1)])
def test_a_step_composed_from_phases_does_what_its_phases_say(dp, dd):
  """``make_train_step(..., phases=)``: the ensemble's update and no resampling, with a weighing that tempers at
  tau = 2 (``reweigh`` under a spec with a temperature): every particle trains on its own gradient (the ensemble's
  reference), and the weights are the tempered losses' (a numpy sum over the steps)."""
  from ipf_jax.spmd import step as step_lib

  tau, config = 2.0, helpers.tiny_config(num_particles=8, mode="ensemble")
  phases = step_lib.Phases(weigh=step_lib.reweigh, update=step_lib.update_each, resample=None)
  make = lambda s: step_lib.make_train_step(
    s.task, s.tx, dataclasses.replace(s.spec, temperature=tau), s.mesh, phases=phases
  )
  s, ref, spmd, refr = run_both(config, dp, dd, num_steps=3, make_step=make)
  for m, r in zip(spmd, refr):
    np.testing.assert_allclose(m["loss"], r["loss"], rtol=1e-4, atol=1e-5)
  params, _, opt_state = ref.stacked()
  helpers.assert_close(s.host_state().params, params)
  helpers.assert_close(s.host_state().opt_state, opt_state)
  log_w = -tau * np.sum([np.asarray(r["loss"], np.float64) for r in refr], axis=0)
  expected = np.exp(log_w - np.logaddexp.reduce(log_w))
  np.testing.assert_allclose(np.exp(s.host_state().log_weights), expected, rtol=1e-3)
  assert expected.max() > 1.5 / 8, "the weights must be far from uniform for the check to mean anything"


@pytest.mark.parametrize("dp,dd,p,mode", [(4, 2, 8, "ipf"), (8, 1, 8, "ensemble")])
def test_nan_particle_is_culled_and_others_match_reference(dp, dd, p, mode):
  poisoned = 3
  config = helpers.tiny_config(
    num_particles=p, mode=mode, temperature=1.0, correction=0.5, ess_threshold=0.0, resample_every=100
  )
  s, ref, spmd, refr = run_both(config, dp, dd, num_steps=3, poison=poisoned)
  m = spmd[0]
  assert not m["alive"][poisoned] and m["alive"].sum() == p - 1
  assert m["log_weights"][poisoned] == -np.inf
  assert int(m["num_alive"]) == p - 1
  others = [i for i in range(p) if i != poisoned]
  final = s.host_state()
  params, _, _ = ref.stacked()
  helpers.assert_close(jax.tree.map(lambda x: x[others], final.params), jax.tree.map(lambda x: x[others], params))
  for leaf in jax.tree.leaves(jax.tree.map(lambda x: x[others], final.params)):
    assert np.all(np.isfinite(leaf)), "a NaN reached a healthy particle"
  if mode == "ipf":  # a culled particle triggers resampling at once: its slot gets a healthy copy
    assert spmd[0]["resampled"] and spmd[0]["ancestors"][poisoned] != poisoned
    assert all(m["alive"].all() for m in spmd[1:])
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(final.params))
  else:  # no resampling in a deep ensemble: the particle stays culled, the others train on
    assert all(not m["alive"][poisoned] for m in spmd)
  assert_same_run(s, ref, spmd, refr)


def test_all_particles_nonfinite_skips_the_step():
  """Skipped as a whole, resampling included (the schedule asks for one every step)."""
  config = helpers.tiny_config(num_particles=4, resample_every=1)
  s = helpers.Setup(config, 4, 2)
  init = s.host_state()
  for leaf in jax.tree.leaves(init.params):
    leaf[...] = np.nan
  s.state = jax.device_put(init, jax.tree.map(lambda x: x.sharding, s.state))
  images, labels = helpers.particle_batches(4, 1)[0]
  s.state, m = s.train_step(s.state, s.put(images, labels))
  out = s.host_state()
  assert int(m["num_alive"]) == 0 and int(out.num_skipped) == 1 and int(out.step) == 1
  assert not m["resampled"] and int(out.num_resamples) == 0
  np.testing.assert_array_equal(m["ancestors"], np.arange(4))
  helpers.assert_close(out.opt_state, init.opt_state)
  np.testing.assert_array_equal(out.log_weights, init.log_weights)


def _magnify_head(factor, particle):
  """An edit for ``run_both``: that particle's output layer times ``factor``. Its float16 backward
  pass overflows at large loss scales while its loss stays finite."""

  def edit(state):
    state.params["Dense_0"]["kernel"][particle] *= factor

  return edit


# float16 tolerances. Its epsilon is 2^-10 ~ 1e-3, and the vmapped, sharded step and the reference add the
# same products in other orders (which order: XLA's version and optimisation level decide), so differences of
# that order accumulate over steps: 1% relative, 2e-3 absolute. An entry of a float16 gradient is a rounded
# sum of many products, and where they cancel its rounding error is set by the size of the products, not of
# the sum: on jax 0.12 at full optimisation, 10 of 2,304 momentum entries of one leaf (max 0.12) differ by
# up to 0.004. So up to 1% of a leaf's entries may miss the first bound if each stays within 2^-4 (6%) of
# the leaf's largest magnitude; a wrong particle, step or update moves most of a leaf, not 1% of it.
FP16_TOL = {"rtol": 1e-2, "atol": 2e-3, "outliers": 0.01, "outlier_atol": 2.0**-4}


@pytest.mark.full_optimisation
@pytest.mark.parametrize(
  "dp,dd,p,loop,k",
  helpers.mark_slow(
    [(4, 2, 8, "vmap", 1), (8, 1, 8, "unroll", 1), (4, 2, 4, "map", 2)], "4-2-8-vmap-1", "4-2-4-map-2", "8-1-8-unroll-1"
  ),
)
def test_float16_loss_scaling_matches_reference(dp, dd, p, loop, k):
  """One particle's gradient overflows: every particle skips, one scale halves, until it fits; then
  the scale grows again after finite steps, and a particle that diverges later is culled and replaced.
  With k = 2 micro-batches an overflow in either halves the scale once."""
  config = helpers.tiny_config(
    num_particles=p,
    dtype="float16",
    loss_scale_init=2.0**15,
    loss_scale_growth_interval=2,
    temperature=1.0,
    ess_threshold=0.3,
    particle_loop=loop,
    grad_accum_steps=k,
  )
  s, ref, spmd, refr = run_both(config, dp, dd, num_steps=12, edit=_magnify_head(3000.0, 3))
  assert_same_run(s, ref, spmd, refr, **FP16_TOL)
  overflows = [bool(m["overflow"]) for m in spmd]
  scales = [float(m["loss_scale"]) for m in spmd]
  # An overflow step applies no update: the optimizer's count, and the rate the step reports, stay.
  counts = np.cumsum([0] + [not o for o in overflows[:-1]])
  np.testing.assert_allclose([float(m["lr"]) for m in spmd], [float(s.parts.lr_fn(c)) for c in counts], rtol=1e-6)
  if k > 1:  # micro-batches of 2 examples overflow at other scales: the reference decides, as above
    assert overflows[0] and not overflows[-1] and scales[-1] < scales[0]
    return
  assert overflows[:8] == [True] * 8 and not any(overflows[8:])  # 2^15 -> 2^7, one halving per step
  assert scales[:9] == [2.0 ** (15 - k) for k in range(9)] and max(scales[9:]) > scales[8]  # and grows again
  assert all(m["alive"].all() for m in spmd[:8]) and int(s.host_state().num_skipped) == 0  # nobody culled
  assert any(m["resampled"] for m in spmd[8:])  # the runaway particle is culled and refilled


@pytest.mark.full_optimisation
def test_float16_overflow_at_minimum_scale_culls_the_particle():
  """At the lowest scale a non-finite gradient is a divergence: culled and resampled, as in float32."""
  config = helpers.tiny_config(num_particles=8, dtype="float16", loss_scale_init=256.0, temperature=1.0)
  s, ref, spmd, refr = run_both(config, 4, 2, num_steps=3, edit=_magnify_head(3000.0, 3), minimum_scale=256.0)
  assert_same_run(s, ref, spmd, refr, **FP16_TOL)
  assert not spmd[0]["overflow"] and not spmd[0]["alive"][3] and spmd[0]["resampled"]
  assert spmd[0]["ancestors"][3] != 3 and int(s.host_state().num_overflows) == 0


@pytest.mark.slow
@pytest.mark.full_optimisation
def test_float16_single_particle_counts_overflows_not_failures():
  """DDP in float16: overflow steps are skipped and counted apart from non-finite (failed) steps."""
  config = helpers.tiny_config(
    num_particles=1, mode="ddp", dtype="float16", loss_scale_init=2.0**24, loss_scale_growth_interval=2
  )
  s, ref, spmd, refr = run_both(config, 1, 4, num_steps=12)
  assert_same_run(s, ref, spmd, refr, **FP16_TOL)
  out = s.host_state()
  assert 0 < int(out.num_overflows) < 12 and int(out.num_skipped) == 0
  assert spmd[0]["overflow"] and not spmd[-1]["overflow"]


@pytest.mark.parametrize("dp,dd", [(1, 8), (1, 4), (1, 1)])
def test_single_particle_is_textbook_data_parallel_sgd(dp, dd):
  """P = 1 equals full-batch SGD with momentum written out by hand."""
  lr, mu, steps, total = 0.3, 0.9, 5, 10
  config = helpers.tiny_config(
    num_particles=1,
    base_lr=lr,
    lr_scaling="none",
    warmup_steps=0,
    num_train_steps=total,
    momentum=mu,
    nesterov=False,
    weight_decay=0.0,
  )
  s = helpers.Setup(config, dp, dd)
  init = s.host_state()
  params = jax.tree.map(lambda x: x[0], init.params)
  stats = jax.tree.map(lambda x: x[0], init.batch_stats)
  velocity = jax.tree.map(np.zeros_like, params)

  def loss_fn(params, stats, x, y):
    logits, new = s.plain_model.apply({"params": params, "batch_stats": stats}, x, train=True, mutable=["batch_stats"])
    logp = jax.nn.log_softmax(logits)
    return -jax.numpy.mean(logp[np.arange(len(y)), y]), new["batch_stats"]

  grad = jax.jit(jax.grad(loss_fn, has_aux=True))
  for k, (images, labels) in enumerate(helpers.particle_batches(1, steps)):
    s.state, _ = s.train_step(s.state, s.put(images, labels))
    g, stats = grad(params, stats, images[0], labels[0])
    rate = lr * 0.5 * (1 + np.cos(np.pi * k / total))
    velocity = jax.tree.map(lambda v, g: mu * v + np.asarray(g), velocity, g)
    params = jax.tree.map(lambda p, v: p - rate * v, params, velocity)
  out = s.host_state()
  helpers.assert_close(jax.tree.map(lambda x: x[0], out.params), params)
  helpers.assert_close(jax.tree.map(lambda x: x[0], out.batch_stats), stats)
  assert not s.spec.resampling

"""config.fsdp's "data" axis, manual or the compiler's (Auto), compile only: per-device state, peak memory and
collectives of one FSDP train step, the library's manual-over-both-axes FSDP against a ``shard_map`` manual over
"particle" only (``axis_names={"particle"}``) that leaves "data" to the compiler.

  python -m benchmarks.fsdp_auto_axes --dds 4,8                 # ViT-B/16, AdamW, P = 2 on 2 x Dd devices
  python -m benchmarks.fsdp_auto_axes --dds 8 --scan --variants auto,auto_c,auto_block,lib_block,lib
  python -m benchmarks.fsdp_auto_axes --dds 4,8 --markdown      # the rows as one table for BENCHMARKS.md
  python -m benchmarks.fsdp_auto_axes --check                   # numbers: auto / manual / reference, 4 devices

The measurement behind docs/DESIGN.md's choice of the manual "data" axis for config.fsdp (§2 "Mesh and data
layout": the mesh's axes ``Explicit``, the step's ``shard_map`` manual over both axes). Each Dd runs in its own
process (the fake device count is fixed when JAX starts). ``--markdown``: the rows as one table, each
collective's cell its count and the sizes of its replica groups (how many of each where they differ;
"unparsed": a form ``collective_counts`` does not read, such as ``replica_groups=mesh[...] {axes}``). A
benchmark, not a test.

Variants, each one jitted train step (loss mean over the batch, grads, clip by the particle's global norm,
AdamW with decay on kernels), parameters and AdamW state laid out by the library's rule (``fsdp.tree_specs``,
``fsdp.like_params``) so the stored state is the same bytes in every variant:

  lib       the library's own step (``benchmarks.common.Bench``, as ``benchmarks.fsdp_memory`` builds it, with
            P = 2, particle_axis_size = 2, fsdp on, sync='step', the mode's defaults: weights, correction,
            resampling branch), no clipping (its default).
  manual    the minimal step above, ``shard_map`` manual over both axes: ``fsdp.gather`` in the loss
            (all-gather, transposed to a reduce-scatter), ``pmean`` over "data", ``optim.clip_by_global_norm``
            told the shards' dims (``step.update_sharded``). Explicit mesh, as the library's.
  auto      the same step, ``shard_map(..., axis_names={"particle"})``, "data" an Auto axis: no gather, no
            pmean, no dims; ``optax.clip_by_global_norm`` as it is; the compiler inserts the collectives.
            ``jit`` pins the state's shardings (in/out_shardings), the batch P("particle", "data").
  auto_c    auto plus two sharding constraints per leaf: the parameters replicated over "data" where the loss
            reads them (the gather) and the gradients sharded as the parameters (the reduce-scatter).
  auto_block  (with --scan) auto, each block built by models.blocks.make constraining its own parameters
            replicated over "data" as it runs (the library's blocks.gathering hook, a constraint in place of
            fsdp.BlockGather's all_gather); the gradients constrained as in auto_c.
  lib_block (with --scan) lib with fsdp_gather='block'.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import re
import subprocess
import sys
import time

MIB = 2**20
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce")  # the --markdown table's collective columns


def collective_counts(hlo: str, dd: int) -> dict:
  """``{op: {"n": count, "groups": {group size: count}}}`` for the collectives of a compiled HLO module."""
  out = collections.defaultdict(lambda: {"n": 0, "groups": collections.Counter()})
  pat = re.compile(r"\s(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(?:-start)?\(")
  for line in hlo.splitlines():
    m = pat.search(line)
    if not m or "-done(" in line:
      continue
    op = m.group(1)
    size = None
    listed = re.search(r"replica_groups=\{\{([\d,]+)\}", line)
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if listed:
      size = len(listed.group(1).split(","))
    elif iota:
      size = int(iota.group(2))
    elif op == "collective-permute":
      size = "pairs"
    out[op]["n"] += 1
    out[op]["groups"][str(size)] += 1
  return {k: {"n": v["n"], "groups": dict(v["groups"])} for k, v in out.items()}


def memory(compiled) -> dict:
  """XLA's per-device sizes in MiB; ``peak_mib`` = arguments + outputs + temporaries - aliased."""
  m = compiled.memory_analysis()
  return {
    "args_mib": m.argument_size_in_bytes / MIB,
    "out_mib": m.output_size_in_bytes / MIB,
    "temp_mib": m.temp_size_in_bytes / MIB,
    "alias_mib": m.alias_size_in_bytes / MIB,
    "peak_mib": (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)
    / MIB,
  }


def shard_bytes(tree) -> int:
  """Bytes of one device's shards of the abstract arrays in ``tree``."""
  import jax
  import numpy as np

  return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in jax.tree.leaves(tree))


class Setup:
  """Model, optimizer and the state's layout for P particles on a ("particle", "data") mesh."""

  def __init__(
    self, model_name, num_particles, dp, dd, image_size, per_device_batch, min_mb, clip, axis_types, scan=False
  ):
    """The (dp, dd) mesh with ``axis_types``, then the model and optimizers, then the state's layout."""
    import jax

    self.P, self.dp, self.dd = num_particles, dp, dd
    self.mesh = jax.make_mesh((dp, dd), ("particle", "data"), axis_types=axis_types, devices=jax.devices()[: dp * dd])
    self._build_model(model_name, num_particles, dd, image_size, per_device_batch, clip, scan)
    self._build_layout(num_particles, dd, min_mb)

  def _build_model(self, model_name, num_particles, dd, image_size, per_device_batch, clip, scan):
    """The model, the particles' stacked parameter shapes and the two optimizers (manual clip, optax's clip)."""
    import jax
    import jax.numpy as jnp
    import optax

    from ipf_jax import models
    from ipf_jax.spmd import optim

    spec = models.ModelSpec(model_name, 1000 if model_name.startswith("vit") else 10)
    if scan:  # the ViT's blocks as one nn.scan under remat (vit_scan=True, remat=True)
      spec = models.ModelSpec(model_name, 1000, vit_scan=True, remat=True)
    self.model = models.create_model(spec, None)  # no BatchNorm in a ViT; the CNN's BN: see --check
    self.classes = spec.num_classes
    self.image = (image_size, image_size, 3) if model_name.startswith("vit") else (image_size, image_size, 1)
    self.batch = dd * per_device_batch  # per particle
    x1 = jnp.zeros((1,) + self.image, jnp.float32)
    one = jax.eval_shape(lambda: self.model.init(jax.random.PRNGKey(0), x1, train=False))
    stack = lambda s: jax.ShapeDtypeStruct((num_particles,) + tuple(s.shape), s.dtype)
    self.params_shape = jax.tree.map(stack, one["params"])
    self.batch_stats_shape = jax.tree.map(stack, one.get("batch_stats", {}))
    core = optax.adamw(1e-3, weight_decay=0.05, mask=optim.decay_mask)
    self.tx_manual = optax.chain(optim.clip_by_global_norm(clip), core) if clip else core
    self.tx_auto = optax.chain(optax.clip_by_global_norm(clip), core) if clip else core
    self.opt_shape = jax.eval_shape(jax.vmap(self.tx_auto.init), self.params_shape)

  def _build_layout(self, num_particles, dd, min_mb):
    """The library's specs for parameters and AdamW state, their shardings, and the step's abstract arguments."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ipf_jax.spmd import fsdp

    min_bytes = min_mb * MIB
    self.param_specs = fsdp.tree_specs(self.params_shape, dd, min_bytes)
    pairs = list(
      zip(
        jax.tree.leaves(self.param_specs, is_leaf=lambda x: isinstance(x, P)),
        [tuple(x.shape) for x in jax.tree.leaves(self.params_shape)],
      )
    )
    self.opt_specs = fsdp.like_params(self.opt_shape, pairs)
    named = lambda specs: jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
    self.param_sh, self.opt_sh = named(self.param_specs), named(self.opt_specs)
    self.bs_sh = jax.tree.map(lambda _: NamedSharding(self.mesh, P("particle")), self.batch_stats_shape)
    self.batch_sh = NamedSharding(self.mesh, P("particle", "data"))
    self.loss_sh = NamedSharding(self.mesh, P("particle"))
    sds = lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh)
    self.params_abs = jax.tree.map(sds, self.params_shape, self.param_sh)
    self.opt_abs = jax.tree.map(sds, self.opt_shape, self.opt_sh)
    self.bs_abs = jax.tree.map(sds, self.batch_stats_shape, self.bs_sh)
    self.images_abs = jax.ShapeDtypeStruct(
      (num_particles, self.batch) + self.image, jnp.float32, sharding=self.batch_sh
    )
    self.labels_abs = jax.ShapeDtypeStruct((num_particles, self.batch), jnp.int32, sharding=self.batch_sh)

  def args_abs(self):
    """The step's abstract arguments: parameters, AdamW state, batch stats, images, labels."""
    return (self.params_abs, self.opt_abs, self.bs_abs, self.images_abs, self.labels_abs)

  def xent(self, logits, labels):
    """The batch's mean softmax cross-entropy."""
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  def apply(self, params, batch_stats, x):
    """``(logits, new batch_stats)`` in train mode."""
    if batch_stats:
      logits, new = self.model.apply(
        {"params": params, "batch_stats": batch_stats}, x, train=True, mutable=["batch_stats"]
      )
      return logits, new["batch_stats"]
    return self.model.apply({"params": params}, x, train=True), batch_stats


def manual_step(s: Setup):
  """shard_map manual over both axes, the library's pieces: fsdp.gather, pmean over "data", clip told the dims."""
  import jax
  from jax import lax
  from jax.sharding import PartitionSpec as P

  from ipf_jax.spmd import fsdp
  from ipf_jax.spmd import step as step_lib

  dims = fsdp.dims_of(s.param_specs)

  def local(params, opt_state, batch_stats, images, labels):
    """One device's step: the local particles' gathered loss, pmean'd grads and sharded AdamW update."""

    def loss_fn(p, bs, x, y):
      """One particle's loss on its gathered parameters, averaged over "data"."""
      logits, new_bs = s.apply(fsdp.gather(p, dims), bs, x)
      return lax.pmean(s.xent(logits, y), "data"), new_bs

    (loss, batch_stats), grads = jax.vmap(jax.value_and_grad(loss_fn, has_aux=True))(
      params, batch_stats, images, labels
    )
    updates, opt_state = jax.vmap(functools.partial(step_lib.update_sharded, s.tx_manual, dims))(
      grads, opt_state, params
    )
    params = jax.tree.map(lambda a, u: a + u, params, updates)
    return params, opt_state, batch_stats, loss

  b = P("particle", "data")
  bs_specs = jax.tree.map(lambda _: P("particle"), s.batch_stats_shape)
  f = jax.shard_map(
    local,
    mesh=s.mesh,
    in_specs=(s.param_specs, s.opt_specs, bs_specs, b, b),
    out_specs=(s.param_specs, s.opt_specs, bs_specs, P("particle")),
  )
  return jax.jit(f, donate_argnums=(0, 1, 2))


def here(spec):
  """``spec`` on the mesh being traced: inside shard_map the one with "particle" Manual (s.mesh's is refused)."""
  import jax
  from jax.sharding import NamedSharding

  return NamedSharding(jax.sharding.get_abstract_mesh(), spec)


def whole(tree):
  """Each leaf of ``tree`` constrained replicated over "data" (the gather, as a sharding constraint)."""
  import jax
  from jax.sharding import PartitionSpec as P

  return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, here(P())), tree)


def auto_loss(s: Setup, constrain):
  """One particle's loss: parameters as they come (False), whole (True), or whole per block ("block")."""

  def loss_fn(p, bs, x, y):
    """One particle's loss and new batch stats."""
    if constrain == "block":  # each block built by models.blocks.make constrains its own parameters whole
      from ipf_jax.models import blocks

      with blocks.gathering(lambda path, block_params, remat, stacked: whole(block_params)):
        logits, new_bs = s.apply(p, bs, x)  # leaves outside the blocks: left to the compiler
      return s.xent(logits, y), new_bs
    if constrain:
      p = whole(p)
    logits, new_bs = s.apply(p, bs, x)
    return s.xent(logits, y), new_bs

  return loss_fn


def constrain_grads(s: Setup, grads):
  """The local particles' gradients constrained sharded as their parameters (the reduce-scatter)."""
  import jax
  from jax.sharding import PartitionSpec as P

  per = lambda spec: P(*tuple(spec)[1:])  # a [P, ...] leaf's spec without its particle axis
  grad_specs = jax.tree.map(per, s.param_specs, is_leaf=lambda x: isinstance(x, P))
  # inside vmap: the per-particle spec
  return jax.vmap(
    lambda g: jax.tree.map(
      lambda a, sp: jax.lax.with_sharding_constraint(a, here(sp)),
      g,
      grad_specs,
    )
  )(grads)


def auto_step(s: Setup, constrain, loop: str = "vmap"):
  """shard_map manual over "particle" only, "data" the compiler's; the local particles by vmap or lax.map (``loop``)."""
  import jax
  from jax.sharding import PartitionSpec as P

  grad_fn = jax.value_and_grad(auto_loss(s, constrain), has_aux=True)

  def local(params, opt_state, batch_stats, images, labels):
    """One device's step: the local particles' loss, grads and AdamW update, "data" left to the compiler."""
    if loop == "map":
      (loss, batch_stats), grads = jax.lax.map(lambda a: grad_fn(*a), (params, batch_stats, images, labels))
    else:
      (loss, batch_stats), grads = jax.vmap(grad_fn)(params, batch_stats, images, labels)
    if constrain:
      grads = constrain_grads(s, grads)
    updates, opt_state = jax.vmap(s.tx_auto.update)(grads, opt_state, params)
    params = jax.tree.map(lambda a, u: a + u, params, updates)
    return params, opt_state, batch_stats, loss

  pp = P("particle")
  f = jax.shard_map(local, mesh=s.mesh, in_specs=pp, out_specs=pp, axis_names={"particle"})
  return jax.jit(
    f,
    in_shardings=(s.param_sh, s.opt_sh, s.bs_sh, s.batch_sh, s.batch_sh),
    out_shardings=(s.param_sh, s.opt_sh, s.bs_sh, s.loss_sh),
    donate_argnums=(0, 1, 2),
  )


def lib_row(args, dd: int, per_block: bool = False) -> dict:
  """The library's own step (``Bench``) at Dd, gathered per particle or per block: state, memory, collectives."""
  from benchmarks.common import Bench, memory_mib
  from benchmarks.fsdp_memory import OPTIMIZERS, state_bytes
  from ipf_jax.config import defaults

  config = defaults.get_config()
  config.update(model=args.model, num_cpu_devices=0, num_particles=2, particle_axis_size=2, fsdp=True, sync="step")
  config.update(global_batch_size=2 * dd * args.per_device_batch, dtype="float32", **OPTIMIZERS["adamw"])
  config.fsdp_min_size_mb = args.min_size_mb
  if args.scan:
    config.update(vit_scan=True, remat=True)
  config.fsdp_gather = "block" if per_block else "particle"
  t = time.perf_counter()
  bench = Bench(config, (args.image_size, args.image_size, 3), 1000)
  compiled = bench.compiled()
  m = memory(compiled)
  assert abs(m["peak_mib"] - memory_mib(compiled)["peak"]) < 1e-6
  return dict(
    variant="lib_block" if per_block else "lib",
    dd=dd,
    scan=args.scan,
    state_mib=state_bytes(bench.abstract) / MIB,
    compile_s=time.perf_counter() - t,
    **m,
    collectives=collective_counts(compiled.as_text(), dd),
  )


def params_kept_sharded(compiled, s: Setup) -> bool:
  """Whether the compiled program's output parameters keep their input layout (the compiler's own view)."""
  import jax

  out_sh = compiled.output_shardings[0]
  return all(
    o.is_equivalent_to(i, len(a.shape))
    for o, i, a in zip(jax.tree.leaves(out_sh), jax.tree.leaves(s.param_sh), jax.tree.leaves(s.params_abs))
  )


def variant_row(args, dd: int, variant: str) -> dict:
  """One of manual / auto / auto_c / auto_block compiled at Dd: state, memory, collectives, layout kept."""
  import jax

  t = time.perf_counter()
  auto = variant.startswith("auto")
  E, A = jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto
  types = (A, A) if auto else (E, E)
  s = Setup(args.model, 2, 2, dd, args.image_size, args.per_device_batch, args.min_size_mb, args.clip, types, args.scan)
  fn = auto_step(s, {"auto": False, "auto_c": True, "auto_block": "block"}[variant]) if auto else manual_step(s)
  compiled = fn.lower(*s.args_abs()).compile()
  hlo = compiled.as_text()
  if args.dump_hlo:
    with open(f"{args.dump_hlo}/{variant}_dd{dd}{'_scan' if args.scan else ''}.hlo.txt", "w") as f:
      f.write(hlo)
  row = dict(
    variant=variant,
    dd=dd,
    scan=args.scan,
    state_mib=(shard_bytes(s.params_abs) + shard_bytes(s.opt_abs)) / MIB,
    compile_s=time.perf_counter() - t,
    **memory(compiled),
    collectives=collective_counts(hlo, dd),
  )
  row["out_params_sharded_like_in"] = params_kept_sharded(compiled, s)
  return row


def child(args, dd: int) -> list[dict]:
  """The rows of ``--variants`` at Dd, in this process of 2 x Dd devices; a variant that fails is an error row."""
  rows = []
  for variant in args.variants.split(","):
    try:
      if variant.startswith("lib"):
        row = lib_row(args, dd, variant == "lib_block")
      else:
        row = variant_row(args, dd, variant)
    except Exception as e:  # a finding too
      row = dict(variant=variant, dd=dd, error=f"{type(e).__name__}: {str(e)[:1500]}")
    rows.append(row)
    print(json.dumps(row), file=sys.stderr, flush=True)
  return rows


# ---- --check: the numbers on 4 small devices ------------------------------------------------------------------


def axis_types():
  """``(Explicit, Auto)``, JAX's mesh axis types."""
  import jax

  return jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto


def put(tree, shardings):
  """``tree``'s leaves placed with ``shardings``' leaves."""
  import jax

  return jax.tree.map(lambda a, h: jax.device_put(a, h), tree, shardings)


def check_inputs(model_name: str, size: int, clip: float):
  """A (2, 2) Auto setup and its inputs: two particles' parameters, AdamW state, batch stats, images, labels."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  _, A = axis_types()
  ref_s = Setup(model_name, 2, 2, 2, size, 4, 0.0, clip, (A, A))
  rng = np.random.default_rng(0)
  key = jax.random.PRNGKey(0)
  x1 = jnp.zeros((1,) + ref_s.image)
  init = jax.vmap(lambda k: ref_s.model.init(k, x1, train=False))(jax.random.split(key, 2))
  params0 = init["params"]
  bs0 = init.get("batch_stats", {})
  opt0 = jax.vmap(ref_s.tx_auto.init)(params0)
  images = rng.normal(size=(2, ref_s.batch) + ref_s.image).astype(np.float32)
  labels = rng.integers(0, ref_s.classes, size=(2, ref_s.batch)).astype(np.int32)
  return ref_s, (params0, opt0, bs0, images, labels)


def reference_step(ref_s: Setup, inputs):
  """One plain unsharded step (vmap over the particles, optax's clip): what every variant must reproduce."""
  import jax
  import optax

  params0, opt0, bs0, images, labels = inputs

  def ref_step(params, opt_state, bs):
    """The whole step, unsharded."""

    def loss_fn(p, b, x, y):
      """One particle's loss and new batch stats."""
      logits, nb = ref_s.apply(p, b, x)
      return ref_s.xent(logits, y), nb

    (loss, bs), g = jax.vmap(jax.value_and_grad(loss_fn, has_aux=True))(params, bs, images, labels)
    u, opt_state = jax.vmap(ref_s.tx_auto.update)(g, opt_state, params)
    return optax.apply_updates(params, u), opt_state, bs, loss

  return jax.jit(ref_step)(params0, opt0, bs0)


def check_setup(model_name: str, size: int, clip: float, auto: bool) -> Setup:
  """The (2, 2) setup of a check variant: Auto axes, or Explicit (the CNN then with SyncBN over "data")."""
  E, A = axis_types()
  if model_name == "cnn" and not auto:
    # the manual step needs SyncBN written into the model (bn_axis_name="data")
    from ipf_jax import models

    s = Setup(model_name, 2, 2, 2, size, 4, 0.0, clip, (E, E))
    s.model = models.create_model(models.ModelSpec("cnn", 10), "data")
    return s
  return Setup(model_name, 2, 2, 2, size, 4, 0.0, clip, (A, A) if auto else (E, E))


def compare(got, want, s: Setup) -> dict:
  """A variant's step against the reference's: largest differences, and whether the parameters stay sharded."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  diff = max(
    float(jnp.max(jnp.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))
  )
  kept = all(
    g.sharding.is_equivalent_to(h, g.ndim) for g, h in zip(jax.tree.leaves(got[0]), jax.tree.leaves(s.param_sh))
  )
  loss_diff = float(jnp.max(jnp.abs(np.asarray(got[3]) - np.asarray(want[3]))))
  return {"max_abs_diff_vs_reference": diff, "loss_diff": loss_diff, "params_stay_sharded": kept}


def check_variant(model_name: str, size: int, clip: float, variant: str, inputs, want) -> dict:
  """One step of manual / auto / auto_c on the check's inputs, compared with the reference (or its error)."""
  import jax

  params0, opt0, bs0, images, labels = inputs
  auto = variant.startswith("auto")
  try:
    s = check_setup(model_name, size, clip, auto)
    fn = auto_step(s, variant == "auto_c") if auto else manual_step(s)
    got = fn(
      put(params0, s.param_sh),
      put(opt0, s.opt_sh),
      put(bs0, s.bs_sh),
      jax.device_put(images, s.batch_sh),
      jax.device_put(labels, s.batch_sh),
    )
    return compare(got, want, s)
  except Exception as e:
    return {"error": f"{type(e).__name__}: {str(e)[:800]}"}


def check_global_norm(model_name: str, size: int, clip: float, params0) -> float:
  """The per-particle global norm (what clipping reads) of "data"-sharded leaves, as an ordinary reduction."""
  import jax
  import jax.numpy as jnp
  import optax
  from jax.sharding import PartitionSpec as P

  _, A = axis_types()
  s = Setup(model_name, 2, 2, 2, size, 4, 0.0, clip, (A, A))
  norm = jax.jit(
    jax.shard_map(
      jax.vmap(optax.global_norm),
      mesh=s.mesh,
      in_specs=P("particle"),
      out_specs=P("particle"),
      axis_names={"particle"},
    ),
    in_shardings=(s.param_sh,),
  )
  got_norm = norm(put(params0, s.param_sh))
  return float(jnp.max(jnp.abs(got_norm / jax.vmap(optax.global_norm)(params0) - 1)))


def check_model(model_name: str, size: int, clip: float) -> dict:
  """Each variant's step against the reference for one model, and the auto global norm's relative error."""
  ref_s, inputs = check_inputs(model_name, size, clip)
  want = reference_step(ref_s, inputs)
  out = {
    variant: check_variant(model_name, size, clip, variant, inputs, want) for variant in ("manual", "auto", "auto_c")
  }
  out["auto_global_norm_rel_diff"] = check_global_norm(model_name, size, clip, inputs[0])
  return out


def check_particle_loops(clip: float) -> dict:
  """L = 2 particles per device (P = 4 on a (2, 2) mesh) compiles under vmap and lax.map (jax#23019)."""
  _, A = axis_types()
  results = {}
  for loop in ("vmap", "map"):
    try:
      s = Setup("vit_ti16", 4, 2, 2, 32, 4, 0.0, clip, (A, A))
      fn = auto_step(s, True, loop)
      fn.lower(*s.args_abs()).compile()
      results[f"auto_c_L2_{loop}"] = "compiled"
    except Exception as e:
      results[f"auto_c_L2_{loop}"] = f"{type(e).__name__}: {str(e)[:400]}"
  return results


def check_bn_axis_name() -> str:
  """What a model written for the manual step (SyncBN over "data") does in auto mode, where "data" is not manual."""
  from ipf_jax import models

  _, A = axis_types()
  s = Setup("cnn", 2, 2, 2, 8, 4, 0.0, 0.0, (A, A))
  s.model = models.create_model(models.ModelSpec("cnn", 10), "data")
  try:
    fn = auto_step(s, False)
    fn.lower(*s.args_abs()).compile()
    return "compiled"
  except Exception as e:
    return f"{type(e).__name__}: {str(e)[:400]}"


def check_pmean_over_data(mesh) -> str:
  """A ``pmean`` over "data" inside a shard_map manual over "particle" only: it names a non-manual axis."""
  import jax
  import jax.numpy as jnp
  from jax import lax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  def pmean_data(x):
    """The local sum, averaged over "data"."""
    return lax.pmean(jnp.sum(x), "data")

  try:
    f = jax.jit(
      jax.shard_map(
        jax.vmap(pmean_data), mesh=mesh, in_specs=P("particle"), out_specs=P("particle"), axis_names={"particle"}
      )
    )
    f(jax.device_put(jnp.ones((2, 4)), NamedSharding(mesh, P("particle", "data"))))
    return "ran"
  except Exception as e:
    return f"{type(e).__name__}: {str(e)[:400]}"


def population(x):
  """The population's collectives over "particle": psum (correction), ppermute (exchange), cond on the index."""
  from jax import lax

  total = lax.psum(x, "particle")
  moved = lax.ppermute(x, "particle", [(0, 1), (1, 0)])
  kept = lax.cond(lax.axis_index("particle") == 0, lambda a: a * 2, lambda a: a, x)
  return total, moved, kept


def check_population_collectives(mesh):
  """``population`` manual over "particle" on a leaf the compiler shards over "data": values, layout, HLO."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  try:
    sh = NamedSharding(mesh, P("particle", None, "data"))
    f = jax.jit(
      jax.shard_map(population, mesh=mesh, in_specs=P("particle"), out_specs=P("particle"), axis_names={"particle"}),
      in_shardings=(sh,),
      out_shardings=(sh, sh, sh),
    )
    x = np.arange(2 * 3 * 8, dtype=np.float32).reshape(2, 3, 8)
    total, moved, kept = f(jax.device_put(x, sh))
    ok = (
      np.allclose(total, np.broadcast_to(x.sum(0), x.shape))
      and np.allclose(moved, x[::-1])
      and np.allclose(kept, np.stack([2 * x[0], x[1]]))
    )
    hlo = f.lower(jax.device_put(x, sh)).compile().as_text()
    return {
      "values_ok": bool(ok),
      "out_sharded_over_data": all(a.sharding.is_equivalent_to(sh, 3) for a in (total, moved, kept)),
      "collectives": collective_counts(hlo, 2),
    }
  except Exception as e:
    return f"{type(e).__name__}: {str(e)[:400]}"


def check(args) -> dict:
  """Each variant's step against a plain reference on a (2, 2) mesh (every leaf sharded), then auto's limits."""
  import jax

  # a small ViT and the CNN (BatchNorm), each leaf sharded (min 0 MiB)
  results = {
    model_name: check_model(model_name, size, args.clip) for model_name, size in (("vit_ti16", 32), ("cnn", 8))
  }
  results.update(check_particle_loops(args.clip))
  results["auto_with_bn_axis_name_data"] = check_bn_axis_name()
  _, A = axis_types()
  mesh = jax.make_mesh((2, 2), ("particle", "data"), axis_types=(A, A), devices=jax.devices()[:4])
  results["auto_pmean_over_data"] = check_pmean_over_data(mesh)
  # The population's own collectives stay manual over "particle": psum (correction) and ppermute (exchange) of a
  # leaf the compiler shards over "data", and a lax.cond on the particle index (the resampling branch).
  results["auto_particle_collectives_on_data_sharded_leaf"] = check_population_collectives(mesh)
  print(json.dumps(results, indent=1), file=sys.stderr)
  return results


# ---- the parent: one child process per Dd, then the table -----------------------------------------------------


def run_child(argv_extra, devices: int, timeout: int) -> list[dict]:
  """This module run with ``argv_extra`` on ``devices`` fake CPU devices; its last stdout line's JSON."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  argv = [sys.executable, "-m", "benchmarks.fsdp_auto_axes"] + argv_extra
  r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
  sys.stderr.write(r.stderr[-6000:])
  if r.returncode:
    raise RuntimeError(r.stderr[-3000:])
  return json.loads(r.stdout.strip().splitlines()[-1])


def child_argv(args, dd: int) -> list[str]:
  """The child's arguments for one Dd: the parent's settings passed on."""
  extra = [
    f"--child={dd}",
    f"--model={args.model}",
    f"--variants={args.variants}",
    f"--image_size={args.image_size}",
    f"--per_device_batch={args.per_device_batch}",
    f"--min_size_mb={args.min_size_mb}",
    f"--clip={args.clip}",
  ]
  extra += [f"--dump_hlo={args.dump_hlo}"] if args.dump_hlo else []
  extra += ["--scan"] if args.scan else []
  return extra


def collective_cell(row: dict, op: str) -> str:
  """A row's count of ``op``, then its count per replica-group size."""
  c = row["collectives"]
  return f"{c.get(op, {}).get('n', 0)} {c.get(op, {}).get('groups', '')}"


def markdown_cell(row: dict, op: str) -> str:
  """A row's count of ``op`` for --markdown: "0", "12 (groups of 4)" or "13 (12 in groups of 4, 1 in groups of 8)"."""
  c = row["collectives"].get(op, {"n": 0, "groups": {}})
  size = lambda k: "unparsed groups" if k == "None" else f"groups of {k}"  # e.g. replica_groups=mesh[...] {axes}
  if not c["groups"]:
    return str(c["n"])
  if len(c["groups"]) == 1:
    return f"{c['n']} ({size(next(iter(c['groups'])))})"
  return f"{c['n']} (" + ", ".join(f"{v} in {size(k)}" for k, v in c["groups"].items()) + ")"


def print_table(rows: list[dict]) -> None:
  """The rows with temporaries, collective-permutes and compile time (the default output)."""
  print(
    "\n| variant | Dd | state MiB/dev | peak MiB/dev | temp MiB | all-gather | reduce-scatter | all-reduce | "
    "c-permute | compile s |"
  )
  print("|" + "---|" * 10)
  for r in rows:
    if "error" in r:
      print(f"| {r['variant']} | {r['dd']} | error: {r['error'][:200]} |")
      continue
    n = lambda op: collective_cell(r, op)
    print(
      f"| {r['variant']} | {r['dd']} | {r['state_mib']:.0f} | {r['peak_mib']:.0f} | {r['temp_mib']:.0f} | "
      f"{n('all-gather')} | {n('reduce-scatter')} | {n('all-reduce')} | {n('collective-permute')} | "
      f"{r['compile_s']:.0f} |"
    )


def print_markdown(rows: list[dict]) -> None:
  """The rows as one markdown table for BENCHMARKS.md: state, peak and the three FSDP collectives."""
  print("| variant | Dd | state MiB/dev | peak MiB/dev | " + " | ".join(COLLECTIVES) + " |")
  print("|" + "---|" * (4 + len(COLLECTIVES)))
  for r in rows:
    if "error" in r:
      error = r["error"][:200].replace("|", "\\|").replace("\n", " ")
      print(f"| {r['variant']} | {r['dd']} | error: {error} |" + " |" * (1 + len(COLLECTIVES)))
      continue
    cells = " | ".join(markdown_cell(r, op) for op in COLLECTIVES)
    print(f"| {r['variant']} | {r['dd']} | {r['state_mib']:.0f} | {r['peak_mib']:.0f} | {cells} |")


def parse_args(argv=None):
  """The command line (``--child``: this module as one Dd's process, set by the parent)."""
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="vit_b16")
  parser.add_argument("--dds", default="4,8")
  parser.add_argument("--variants", default="manual,auto,auto_c,lib")
  parser.add_argument("--image_size", type=int, default=224)
  parser.add_argument("--per_device_batch", type=int, default=8)
  parser.add_argument("--min_size_mb", type=float, default=1.0)
  parser.add_argument("--clip", type=float, default=1.0, help="per-particle global-norm clip (0: none)")
  parser.add_argument("--timeout", type=int, default=1800, help="seconds per child process")
  parser.add_argument("--dump_hlo", default="")
  parser.add_argument(
    "--scan",
    action="store_true",
    help="ViT blocks as one nn.scan under remat (lib_block: the library's fsdp_gather='block')",
  )
  parser.add_argument("--check", action="store_true")
  parser.add_argument(
    "--markdown",
    action="store_true",
    help="print the rows as one markdown table (variant, Dd, state, peak, all-gather, reduce-scatter, all-reduce); "
    "the SUMMARY line then goes to stderr",
  )
  parser.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.check and args.markdown:
    parser.error("--markdown prints the benchmark's rows; --check has none")
  return args


def main():
  """The parent (one child per Dd, then the table), the --check run, or a child."""
  args = parse_args()
  if args.child:
    print(json.dumps(check(args) if args.check else child(args, args.child)))
    return
  if args.check:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    argv = [sys.executable, "-m", "benchmarks.fsdp_auto_axes", "--child=4", "--check", f"--clip={args.clip}"]
    subprocess.run(argv, env=env, timeout=args.timeout, check=True)
    return
  rows = []
  for dd in [int(x) for x in args.dds.split(",")]:
    rows += run_child(child_argv(args, dd), 2 * dd, args.timeout)
  if args.markdown:
    print_markdown(rows)
    print("SUMMARY " + json.dumps(rows), file=sys.stderr)
    return
  print_table(rows)
  print("SUMMARY " + json.dumps(rows))


if __name__ == "__main__":
  main()

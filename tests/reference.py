"""A plain reference implementation of DESIGN.md §3 for the tests.

Python loops over particles, numpy for the filter; no vmap, no shard_map, no
collectives. BatchNorm sees each particle's whole shard at once, which is what
SyncBN over the "data" axis computes. With ``loss_scale`` (float16), the
textbook dynamic loss scaling rule, written out: one scale for all particles. Shares only the RNG contract with the
library: step k uses key fold_in(rng, k); the resampling uniform comes from
fold_in(key, 0); the jitter of slot n is normal(fold_in(fold_in(key, 1), n), (its number of weights,))
in float32, cut into the leaves in tree-flatten order.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax


def logsumexp(x):
  x = np.asarray(x, np.float64)
  m = np.max(x)
  if not np.isfinite(m):
    return -np.inf
  return m + np.log(np.sum(np.exp(x - m)))


def systematic_ancestors(weights, u):
  """Loop version: a_n = first i with cumsum(w)_i > (n + u) / P."""
  p = len(weights)
  c = np.cumsum(np.asarray(weights, np.float64))
  c = c / c[-1]
  last = max(i for i in range(p) if weights[i] > 0)
  out = []
  for n in range(p):
    pos = (n + u) / p
    i = 0
    while i < p and c[i] <= pos:
      i += 1
    out.append(min(i, last))
  return out


def island_normalize(log_w, islands):
  """Each island's weights normalised on its own, times ``1 / (islands with a finite weight)``."""
  log_w = np.array(log_w, np.float64)
  n = len(log_w) // islands
  blocks = [log_w[g * n : (g + 1) * n] for g in range(islands)]
  live = [g for g in range(islands) if np.isfinite(logsumexp(blocks[g]))]
  for g in live:
    log_w[g * n : (g + 1) * n] = blocks[g] - logsumexp(blocks[g]) - np.log(len(live))
  return log_w


def island_ess(w, islands):
  """``islands`` times the smallest island's ``(sum w)^2 / sum w^2`` (0 for an island without weight)."""
  n = len(w) // islands
  own = []
  for g in range(islands):
    block = np.asarray(w[g * n : (g + 1) * n], np.float64)
    own.append(block.sum() ** 2 / np.sum(block**2) if block.sum() > 0 else 0.0)
  return islands * min(own)


def island_sources(w, u, islands):
  """``src`` of a resampling: each island's own systematic resampling (same ``u``) with survivors in their
  slots; an island without weight copies the next island (cyclically) that has weight."""
  n = len(w) // islands
  per_island = []
  for g in range(islands):
    block = list(w[g * n : (g + 1) * n])
    own = survivor_slots(systematic_ancestors(block, u)) if sum(block) > 0 else None
    per_island.append(None if own is None else [g * n + a for a in own])
  src = []
  for g in range(islands):
    donor = next(h % islands for h in range(g, g + islands) if per_island[h % islands] is not None)
    src += per_island[donor]
  return src


def survivor_slots(ancestors):
  """Survivors keep their slot; freed slots (ascending) take the extra copies (ascending)."""
  p = len(ancestors)
  survivors = set(ancestors)
  seen, extras = set(), []
  for a in ancestors:
    if a in seen:
      extras.append(a)
    seen.add(a)
  freed = [n for n in range(p) if n not in survivors]
  src = list(range(p))
  for slot, a in zip(freed, extras):
    src[slot] = a
  return src


def rounds(src, num_local):
  """``(across, within)``: the distinct (shift, slot) pairs the moved slots of ``src`` need, shift > 0 and
  shift 0 (``exchange_rounds``'s rounds)."""
  dp = len(src) // num_local
  need = {((n // num_local - src[n] // num_local) % dp, n % num_local) for n in range(len(src)) if src[n] != n}
  return sum(k > 0 for k, _ in need), sum(k == 0 for k, _ in need)


def local_slots(src, num_local, islands):
  """``resample_placement="local"`` by plain loops: survivors stay; while a slot is free, the round (shift
  ``k`` from the device ``t - k``, into slot ``j`` of every device ``t``) that fills the most free slots, a
  round within a device first, ties to the smallest ``(k, j)``; a filled slot takes the lowest-index copy
  still waiting on its source device in its island (a copy's index: the slot ``src`` gave it). ``src`` itself
  where that would need more rounds across devices (or as many and more in all)."""
  p = len(src)
  dp, size = p // num_local, p // islands
  moved = [n for n in range(p) if src[n] != n]
  waiting, free, out = list(moved), set(moved), list(src)

  def copy_for(t, k, j):  # the copy slot j of device t would take in round (k, j), or None
    n = t * num_local + j
    if n not in free:
      return None
    for e in waiting:  # ascending
      if src[e] // num_local == (t - k) % dp and e // size == n // size:
        return e
    return None

  while free:
    best = None
    for k in range(dp):
      for j in range(num_local):
        fills = sum(copy_for(t, k, j) is not None for t in range(dp))
        score = fills + (p if k == 0 and fills else 0)
        if best is None or score > best[0]:
          best = (score, k, j)
    _, k, j = best
    for t in range(dp):
      e = copy_for(t, k, j)
      if e is not None:
        out[t * num_local + j] = src[e]
        waiting.remove(e)
        free.discard(t * num_local + j)
  (across, within), (was_across, was_within) = rounds(out, num_local), rounds(src, num_local)
  return out if (across, across + within) <= (was_across, was_across + was_within) else list(src)


def _split(tree, pattern):
  """(rest, shared) by regex on '/'-joined paths, as nested dicts."""
  from flax import traverse_util

  flat = traverse_util.flatten_dict(tree, sep="/")
  pick = lambda keep: traverse_util.unflatten_dict(
    {k: v for k, v in flat.items() if bool(pattern and re.search(pattern, k)) == keep}, sep="/"
  )
  return pick(False), pick(True)


def _merge(a, b):
  from flax import traverse_util

  flat = traverse_util.flatten_dict(a, sep="/")
  flat.update(traverse_util.flatten_dict(b, sep="/"))
  return traverse_util.unflatten_dict(flat, sep="/")


def _finite(tree):
  return all(bool(np.all(np.isfinite(x))) for x in jax.tree.leaves(tree))


class Reference:
  """Holds per-particle lists and runs steps one particle at a time."""

  def __init__(
    self,
    model,
    tx,
    spec,
    params,
    batch_stats,
    opt_state,
    log_weights,
    rng,
    shared=None,
    shared_opt_state=None,
    shared_pattern="",
    loss_scale=None,
    growth_interval=2000,
    minimum_scale=1.0,
    lr_fn=None,
    mixup=0.0,
    num_classes=10,
    particle_devices=1,
  ):
    self.spec = spec
    self.particle_devices = particle_devices  # Dp: spec.resample_placement="local" places copies by the mesh
    self.mixup, self.num_classes = mixup, num_classes  # config.mixup: each particle's batch mixed, as below
    self.lr_fn = lr_fn  # spec.jitter_lr: the copies' noise is jitter + jitter_lr * lr_fn(step)
    self.accum_steps = spec.grad_accum_steps
    self.tx = tx
    self.rng = rng
    p = spec.num_particles
    take = lambda tree, i: jax.tree.map(lambda x: np.asarray(x[i]), tree)
    self.params = [take(params, i) for i in range(p)]
    self.batch_stats = [take(batch_stats, i) for i in range(p)]
    self.opt_state = [take(opt_state, i) for i in range(p)]
    self.log_w = np.asarray(log_weights, np.float64)
    self.step = 0
    self.num_resamples = 0
    self.pattern = shared_pattern
    self.shared = jax.tree.map(np.asarray, shared or {})
    self.shared_opt_state = shared_opt_state if shared_opt_state is not None else tx.init(self.shared)
    self.loss_scale = loss_scale
    self.growth_interval = growth_interval
    self.minimum_scale = minimum_scale
    self.finite_steps = 0  # finite steps since the scale last changed
    self.num_overflows = 0

    def loss_fn(params, batch_stats, image, label, scale):
      logits, new = model.apply(
        {"params": params, "batch_stats": batch_stats}, image, train=True, mutable=["batch_stats"]
      )
      if label.ndim == 2:  # soft targets (mixup)
        return scale * optax.softmax_cross_entropy(logits, label).mean(), new["batch_stats"]
      return scale * optax.softmax_cross_entropy_with_integer_labels(logits, label).mean(), new["batch_stats"]

    grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))

    def scaled_grad(params, batch_stats, image, label):
      scale = np.float32(1.0 if self.loss_scale is None else self.loss_scale)
      (loss, bs), g = grad(params, batch_stats, image, label, scale)
      return (loss / scale, bs), jax.tree.map(lambda x: np.asarray(x, np.float32) / scale, g)

    self._grad = scaled_grad
    self._update = jax.jit(tx.update)

  def _mix(self, images, labels, key):
    """mixup written out in numpy: r ~ Dirichlet(p, p) sorted r_0 >= r_1 (the one draw taken from jax's
    generator), each example and its one-hot label blended with the one before it in the particle's
    (micro-)batch, the first with the last."""
    r = np.sort(np.asarray(jax.random.dirichlet(key, jnp.full((2,), self.mixup, jnp.float32))))[::-1]
    onehot = np.eye(self.num_classes, dtype=np.float32)[labels]
    blend = lambda x: (r[0] * x + r[1] * np.roll(x, 1, axis=0)).astype(np.float32)
    return blend(np.asarray(images, np.float32)), blend(onehot)

  def _accumulated_grad(self, params, batch_stats, images, labels, mix_key=None):
    """Gradient accumulation written out: micro-batch m is examples m, m + k, ... of the particle's batch,
    run one after another (BatchNorm statistics carried); the loss and gradient are their means.
    ``mix_key(m)``: micro-batch m's mixup key (None: no mixup)."""
    k = self.accum_steps
    losses, grads = [], []
    for m in range(k):
      x, y = images[m::k], labels[m::k]
      if mix_key is not None:
        x, y = self._mix(x, y, mix_key(m))
      (loss, batch_stats), g = self._grad(params, batch_stats, x, y)
      losses.append(float(loss))
      grads.append(g)
    mean = jax.tree.map(lambda *gs: sum(np.asarray(x, np.float64) for x in gs) / k, *grads)
    return (float(np.mean(losses)), batch_stats), jax.tree.map(lambda x: x.astype(np.float32), mean)

  def train_step(self, images, labels):
    """One step on ``images[i]`` for particle ``i``; returns a record of what happened."""
    s = self.spec
    p = s.num_particles
    key = jax.random.fold_in(self.rng, self.step)
    losses, grads, stats, alive = [], [], [], []
    shared_grads = []
    augment = jax.random.fold_in(key, 3)  # the step's augmentation stream; per micro-batch, then per slot
    for i in range(p):

      def mix_key(m, i=i):
        return jax.random.fold_in(augment if self.accum_steps == 1 else jax.random.fold_in(augment, m), i)

      (loss, bs), g = self._accumulated_grad(
        _merge(self.params[i], self.shared),
        self.batch_stats[i],
        images[i],
        labels[i],
        mix_key if self.mixup else None,
      )
      g, g_shared = _split(g, self.pattern)
      shared_grads.append(g_shared)
      ok = bool(np.isfinite(loss)) and _finite(g)
      losses.append(float(loss))
      alive.append(ok)
      grads.append(g if ok else jax.tree.map(jnp.zeros_like, g))
      if not ok:
        shared_grads[-1] = jax.tree.map(jnp.zeros_like, g_shared)
      stats.append(bs)
    record = {"loss": losses, "alive": alive, "resampled": False, "ancestors": list(range(p))}
    if self.loss_scale is not None:
      record["loss_scale"] = self.loss_scale
      # A finite loss with a non-finite gradient: above the minimum scale, everyone skips and the
      # scale halves; at the minimum, that particle is culled like any non-finite one.
      overflow = any(np.isfinite(losses[i]) and not alive[i] for i in range(p))
      record["overflow"] = overflow and self.loss_scale > self.minimum_scale
      if any(np.isfinite(losses)):
        if overflow:
          self.loss_scale, self.finite_steps = max(self.loss_scale / 2, self.minimum_scale), 0
        elif self.finite_steps == self.growth_interval:
          self.loss_scale, self.finite_steps = self.loss_scale * 2, 0
        else:
          self.finite_steps += 1
      if record["overflow"]:  # nobody is culled, nothing changes but the scale
        record["alive"] = [bool(np.isfinite(x)) for x in losses]
        self.num_overflows += 1
        self.step += 1
        return record
    log_w = np.array(
      [s.forgetting * self.log_w[i] - s.temperature * losses[i] if alive[i] else -np.inf for i in range(p)]
    )
    if not any(alive):
      self.step += 1
      return record
    log_w = island_normalize(log_w, s.islands)
    w = np.exp(log_w)
    consensus = None
    for j in range(p):
      if w[j] > 0:
        term = jax.tree.map(lambda g: w[j] * g, grads[j])
        consensus = term if consensus is None else jax.tree.map(lambda a, b: a + b, consensus, term)
    for i in range(p):
      d = grads[i]
      if s.correction > 0:
        d = jax.tree.map(lambda g, c: (1 - s.correction) * g + s.correction * c, grads[i], consensus)
      updates, self.opt_state[i] = self._update(d, self.opt_state[i], self.params[i])
      self.params[i] = optax.apply_updates(self.params[i], updates)
      self.batch_stats[i] = stats[i]
    if s.elastic_pull and (self.step + 1) % s.elastic_pull_every == 0:  # towards theta_bar = sum_j w_j theta_j
      fused = jax.tree.map(
        lambda *xs: sum(w[j] * np.asarray(xs[j], np.float64) for j in range(p) if w[j] > 0), *self.params
      )
      self.params = [
        jax.tree.map(
          lambda x, f: ((1 - s.elastic_pull) * np.asarray(x, np.float64) + s.elastic_pull * f).astype(np.float32),
          prm,
          fused,
        )
        for prm in self.params
      ]
    if self.pattern:  # one update of the shared parameters with the weighted consensus gradient
      consensus_shared = jax.tree.map(lambda *gs: sum(w[j] * gs[j] for j in range(p) if w[j] > 0), *shared_grads)
      updates, self.shared_opt_state = self._update(consensus_shared, self.shared_opt_state, self.shared)
      self.shared = optax.apply_updates(self.shared, updates)
    ess = island_ess(w, s.islands)
    record["ess"] = ess
    record["log_weights"] = log_w
    resample = s.resampling and (
      ess < s.ess_threshold * p or not all(alive) or (s.resample_every > 0 and (self.step + 1) % s.resample_every == 0)
    )
    if resample:
      u = float(jax.random.uniform(jax.random.fold_in(key, 0)))
      src = island_sources(w, u, s.islands)
      if s.resample_placement == "local":
        src = local_slots(src, p // self.particle_devices, s.islands)
      self.params = [self.params[a] for a in src]
      self.batch_stats = [self.batch_stats[a] for a in src]
      self.opt_state = [self.opt_state[a] for a in src]
      sigma = s.jitter + (s.jitter_lr * float(self.lr_fn(self.step)) if s.jitter_lr else 0.0)
      if sigma:
        jkey = jax.random.fold_in(key, 1)
        for n in range(p):
          if src[n] != n:
            k = jax.random.fold_in(jkey, n)
            leaves, treedef = jax.tree.flatten(self.params[n])
            eps = np.asarray(jax.random.normal(k, (sum(x.size for x in leaves),)))
            ends = np.cumsum([x.size for x in leaves])
            leaves = [
              x + (sigma * eps[end - x.size : end].reshape(x.shape)).astype(x.dtype) for x, end in zip(leaves, ends)
            ]
            self.params[n] = jax.tree.unflatten(treedef, leaves)
      log_w = np.full(p, -np.log(p))
      self.num_resamples += 1
      record.update(resampled=True, ancestors=src)
    self.log_w = log_w
    self.step += 1
    return record

  def stacked(self):
    """The particles as ``[P, ...]`` trees, to compare with the SPMD state."""
    stack = lambda trees: jax.tree.map(lambda *xs: np.stack(xs), *trees)
    return stack(self.params), stack(self.batch_stats), stack(self.opt_state)


class OuterReference(Reference):
  """The outer loop (DESIGN.md §3b) written out with loops: each particle's plain optimizer step on its own
  batch; at a sync, every particle's loss (before the step, train mode) on the same examples (the first ``k``
  of every particle's part of each data shard's batch, all shards together: SyncBN), the weights, the weighted
  mean, the anchor's outer step (``outer_tx`` on ``A - mean``), resampling on low ESS or a culled particle,
  weights ``w^(1 - gamma)`` renormalised, and the pull ``x + gamma (target - x)`` of parameters (to the anchor)
  and BatchNorm statistics (to their weighted mean). The anchor starts at the particles' mean and takes SGD
  steps with Nesterov momentum written out: ``m <- delta + mu m``, ``A <- A - lr (delta + mu m)``. Optimizer
  states: ``keep``; ``reset``, their float leaves as ``tx.init`` of the pulled parameters, counts kept;
  ``average``, their float leaves pulled to the weighted mean. The last sync (``gamma = 0``) resamples only
  to replace a dead particle."""

  def __init__(
    self, *args, outer_lr, outer_momentum, opt_policy, sync_examples, data_devices, sync_temperature, **kwargs
  ):
    super().__init__(*args, **kwargs)
    self.sync_examples, self.data_devices, self.sync_temperature = sync_examples, data_devices, sync_temperature
    self.outer_lr, self.outer_momentum, self.opt_policy = outer_lr, outer_momentum, opt_policy
    p = self.spec.num_particles
    self.anchor = jax.tree.map(lambda *xs: sum(np.asarray(x, np.float64) for x in xs) / p, *self.params)
    self.momentum = jax.tree.map(np.zeros_like, self.anchor)
    model = args[0]

    def score_fn(params, batch_stats, image, label):
      logits, _ = model.apply(
        {"params": params, "batch_stats": batch_stats}, image, train=True, mutable=["batch_stats"]
      )
      return optax.softmax_cross_entropy_with_integer_labels(logits, label).mean()

    self._score = jax.jit(score_fn)

  def _common(self, images, labels):
    p, b = len(images), len(images[0]) // self.data_devices
    k = min(self.sync_examples, b)
    rows = [(j, d * b + e) for d in range(self.data_devices) for j in range(p) for e in range(k)]
    return np.stack([images[j][e] for j, e in rows]), np.stack([labels[j][e] for j, e in rows])

  def _to_anchor(self) -> list:
    """Each particle's distance to the anchor (float64)."""
    anchor = jax.tree.leaves(self.anchor)
    sq = lambda prm: sum(np.sum(np.square(np.asarray(x, np.float64) - a)) for x, a in zip(jax.tree.leaves(prm), anchor))
    return [np.sqrt(sq(prm)) for prm in self.params]

  def train_step(self, images, labels, sync=False, gamma=1.0):
    s, p = self.spec, self.spec.num_particles
    key = jax.random.fold_in(self.rng, self.step)
    record = {"loss": [], "alive": [], "resampled": False, "ancestors": list(range(p))}
    if sync:
      x, y = self._common(images, labels)
      scores = [float(self._score(self.params[i], self.batch_stats[i], x, y)) for i in range(p)]
    for i in range(p):
      (loss, bs), g = self._accumulated_grad(self.params[i], self.batch_stats[i], images[i], labels[i])
      ok = bool(np.isfinite(loss)) and _finite(g)
      record["loss"].append(float(loss))
      record["alive"].append(ok)
      if ok:
        updates, self.opt_state[i] = self._update(g, self.opt_state[i], self.params[i])
        self.params[i] = optax.apply_updates(self.params[i], updates)
        self.batch_stats[i] = bs
      else:
        self.log_w[i] = -np.inf
    self.step += 1
    if not sync:
      return record
    alive = [record["alive"][i] and np.isfinite(scores[i]) and np.isfinite(self.log_w[i]) for i in range(p)]
    log_w = np.array(
      [s.forgetting * self.log_w[i] - self.sync_temperature * scores[i] if alive[i] else -np.inf for i in range(p)]
    )
    log_w = island_normalize(log_w, s.islands)
    w = np.exp(log_w)
    mean = lambda trees: jax.tree.map(
      lambda *xs: sum(w[j] * np.asarray(xs[j], np.float64) for j in range(p) if w[j] > 0), *trees
    )
    theta_bar, beta_bar = mean(self.params), mean(self.batch_stats)
    record["diversity"] = np.where(np.isfinite(log_w), self._to_anchor(), np.nan)  # before the anchor's step
    delta = jax.tree.map(lambda a, m: a - m, self.anchor, theta_bar)
    mu = self.outer_momentum
    self.momentum = jax.tree.map(lambda d, m: d + mu * m, delta, self.momentum)
    self.anchor = jax.tree.map(lambda a, d, m: a - self.outer_lr * (d + mu * m), self.anchor, delta, self.momentum)
    floats = lambda x: np.issubdtype(np.asarray(x).dtype, np.floating)
    opt_bar = mean([jax.tree.map(lambda x: np.asarray(x, np.float64) if floats(x) else 0.0, o) for o in self.opt_state])
    ess = island_ess(w, s.islands)
    record.update(ess=ess, score=scores)
    if (ess < s.ess_threshold * p and gamma > 0) or not all(alive):
      u = float(jax.random.uniform(jax.random.fold_in(key, 0)))
      src = island_sources(w, u, s.islands)
      self.params = [self.params[a] for a in src]
      self.batch_stats = [self.batch_stats[a] for a in src]
      self.opt_state = [self.opt_state[a] for a in src]
      log_w = np.full(p, -np.log(p))
      self.num_resamples += 1
      record.update(resampled=True, ancestors=src)
    self.log_w = island_normalize((1.0 - gamma) * log_w, s.islands)
    pull = lambda x, t: (np.asarray(x, np.float64) + gamma * (np.asarray(t, np.float64) - x)).astype(np.float32)
    self.params = [jax.tree.map(pull, prm, self.anchor) for prm in self.params]
    self.batch_stats = [jax.tree.map(pull, bs, beta_bar) for bs in self.batch_stats]
    for i in range(p):
      if self.opt_policy == "reset" and gamma > 0:
        fresh = self.tx.init(self.params[i])
        self.opt_state[i] = jax.tree.map(lambda n, o: np.asarray(n) if floats(o) else o, fresh, self.opt_state[i])
      elif self.opt_policy == "average":
        self.opt_state[i] = jax.tree.map(lambda o, m: pull(o, m) if floats(o) else o, self.opt_state[i], opt_bar)
    return record

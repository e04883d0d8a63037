"""float16's dynamic loss scaling as one policy of the train step (DESIGN.md §3.6).

The step asks its policy, ``of(state)``, at each place where float16 differs, and never tests the dtype:

  value_and_grad  phase 1: the scaled loss's gradient, unscaled, and the particle's proposed next scale
  merge           phase 1 with grad_accum_steps: the smallest proposal of the micro-batches
  vote            phase 1's end: what the particle says about the next scale (``Vote``), gathered in phase 2
  decide          phase 4: one scale for all particles, and whether the step overflowed (then skipped whole)
  metrics         what an overflow step reports (the weights and culls before it, not the discarded update)
  count           the state's scale and overflow count after the step

``Unscaled`` (float32, bfloat16) is the step without any of this: no vote, no field, no operation.
``LossScaling`` wraps the state's flax ``DynamicScale`` (``optim.create_dynamic_scale``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax.training.dynamic_scale import DynamicScale

from ipf_jax.population import particle_filter as pf


class Vote(NamedTuple):
  """A particle's say in the next loss scale (``[L]``, gathered to ``[P]`` with the step's other numbers)."""

  overflow: jax.Array  # 1.0: a finite loss with a non-finite gradient
  scale: jax.Array  # the scale it proposes; inf where its loss is not finite (no vote)
  fin_steps: jax.Array  # the finite-step count it proposes; inf likewise


class Unscaled:
  """No loss scaling (float32, bfloat16): the float16 policy's methods as the identity of the step."""

  def value_and_grad(self, fn: Callable, argnums) -> Callable:
    """``(aux, grads, None)`` of ``fn``, which returns ``(loss, aux)``."""
    grad_fn = jax.value_and_grad(fn, argnums=argnums, has_aux=True)
    return lambda *args: (*grad_fn(*args), None)

  def merge(self, proposed, other):
    return None

  def vote(self, proposed, loss, alive) -> Optional[Vote]:
    return None

  def decide(self, votes: Optional[Vote]):
    """``(scale, overflow)``: never an overflow."""
    return None, jnp.zeros((), bool)

  def metrics(self, spec, metrics: dict, votes, previous_log_weight, overflow) -> dict:
    return metrics

  def count(self, state, new_state, decided, overflow):
    return new_state


@dataclasses.dataclass(frozen=True)
class LossScaling:
  """float16: one flax ``DynamicScale`` for all particles.

  Each particle proposes the next scale from its own gradient (halved on an overflow, doubled after
  ``growth_interval`` finite steps). Above the minimum scale, a finite loss with a non-finite gradient
  is an overflow: every particle skips the step and the scale halves. Every proposal is the same when
  all gradients are finite; the smallest is the decision. No finite loss at all: the scale stays. At the
  minimum scale an overflow is a divergence (culled, as in float32), not a skip.
  """

  scale: DynamicScale

  def value_and_grad(self, fn: Callable, argnums) -> Callable:
    """``(aux, grads, proposed)``: flax's scaled loss and unscaled gradients, and the proposed scale."""

    def grad_fn(*args):
      proposed, _, aux, grads = self.scale.value_and_grad(fn, argnums=argnums, has_aux=True)(*args)
      return aux, grads, proposed

    return grad_fn

  def merge(self, proposed: DynamicScale, other: DynamicScale) -> DynamicScale:
    """Two micro-batches' proposals as one: the smaller (an overflow in either halves the scale)."""
    return proposed.replace(
      scale=jnp.minimum(proposed.scale, other.scale), fin_steps=jnp.minimum(proposed.fin_steps, other.fin_steps)
    )

  def vote(self, proposed: DynamicScale, loss, alive) -> Vote:
    """``[L]``: each particle's overflow and proposal (no vote where its loss is not finite), in the
    loss's dtype, as the step's other numbers."""
    finite = jnp.isfinite(loss)
    no_vote = lambda x: jnp.where(finite, x, jnp.inf).astype(loss.dtype)
    return Vote((finite & ~alive).astype(loss.dtype), no_vote(proposed.scale), no_vote(proposed.fin_steps))

  def decide(self, votes: Vote) -> tuple[DynamicScale, jax.Array]:
    """``(next DynamicScale, overflow)`` from the population's gathered votes ``[P]``."""
    ds = self.scale
    overflow = (jnp.sum(votes.overflow) > 0) & (ds.scale > ds.minimum_scale)
    scale = jnp.min(votes.scale)
    decided = ds.replace(scale=scale, fin_steps=jnp.min(votes.fin_steps).astype(jnp.int32))
    return jax.tree.map(lambda new, old: jnp.where(jnp.isfinite(scale), new, old), decided, ds), overflow

  def metrics(self, spec, metrics: dict, votes: Vote, previous_log_weight, overflow) -> dict:
    """The loss scale and overflow; on an overflow step nobody is culled and the weights stay, so the
    metrics report them as they were before the step."""
    alive = jnp.asarray(metrics["alive"])
    finite = (alive + votes.overflow) > 0
    kept = {
      "log_weights": previous_log_weight,
      "ess": pf.ess(previous_log_weight, spec.islands),
      "alive": finite.astype(jnp.int32),
      "num_alive": jnp.sum(finite).astype(jnp.int32),
    }
    metrics = {**metrics, **{k: jnp.where(overflow, v, metrics[k]) for k, v in kept.items()}}
    return {**metrics, "loss_scale": self.scale.scale, "overflow": overflow}

  def count(self, state, new_state, decided: DynamicScale, overflow):
    """The decided scale, and one more overflow if there was one."""
    return new_state.replace(dynamic_scale=decided, num_overflows=state.num_overflows + overflow.astype(jnp.int32))


Policy = Any  # Unscaled | LossScaling


def of(state) -> Policy:
  """The policy of a ``ParticleState``: ``LossScaling`` where it holds a loss scale (float16), else ``Unscaled``."""
  return Unscaled() if state.dynamic_scale is None else LossScaling(state.dynamic_scale)

"""What is trained and how it is scored (DESIGN.md "Library use").

A ``Task`` holds any Flax module, a per-example loss, and how a prediction is
scored. The ensembles of a population are mixtures: for every example,
``predictive`` returns quantities that are linear in the predictive
distribution (class probabilities; the density of the label and the first two
moments for regression), the ensembles average them with the particles'
weights (a quantity under a ``log_`` key is a log-value and is mixed in log
space, see ``evaluation.mixture``), and ``score`` turns one model's (or one
mixture's) quantities into additive sums, so that eval batches and devices
combine with ``+``/``psum``.

The model is called as ``model.apply(variables, batch[inputs], train=train)``
(``inputs=None``: the whole batch dict), with a ``"dropout"`` key (one per
particle and data shard, derived from the step) when ``rngs`` asks for it, and
``batch_stats`` mutable in train mode when the model has BatchNorm. A Flax NNX
module (or a constructor ``rngs -> nnx.Module``) is taken as it is: it is split
into ``params`` (``nnx.Param``) and ``batch_stats`` (``nnx.BatchStat``), its RNG
streams are keyed per particle and step, and it is called as ``module(inputs)``
after ``module.train()`` / ``module.eval()`` (``ipf_jax.spmd.nnx_bridge``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax import lax

from ipf_jax.evaluation import metrics as metrics_lib
from ipf_jax.spmd import nnx_bridge
from ipf_jax.spmd.mesh import DATA


@dataclasses.dataclass(frozen=True)
class Task:
  """A model and how it learns and is scored.

  Attributes:
    model: any Flax Linen module taking ``(inputs, train=bool)``; or a Flax NNX module called as
      ``module(inputs)`` (an instance: every particle starts from its values; a constructor
      ``rngs -> nnx.Module``: each particle from its own key), see ``ipf_jax.spmd.nnx_bridge``.
    loss: ``(outputs, batch) -> [b]`` per-example loss (a particle's loss is its mean over the
      particle's examples; the gradient flows through it).
    predictive: ``(outputs, batch) -> pytree of [b, ...]``: what the ensembles average.
    score: ``(predictive, batch, mask [b]) -> dict of additive sums`` for one model or mixture.
    finalize: host ``sums -> {metric: value}``.
    columns: ``(title, metric, format)`` of the final table, e.g. ``("NLL", "nll", "{:.4f}")``.
    inputs: the batch field the model takes, or ``None`` for the whole batch.
    rngs: RNG streams the model draws in train mode, e.g. ``("dropout",)`` (NNX: by default the streams
      its ``nnx.Rngs`` hold).
    diversity: ``(predictive [L, b, ...], alive [L], mask [b], total) -> dict of additive sums`` of the
      population's diversity (``total`` sums an array over all particles), or ``None``.
    finalize_diversity: host ``sums -> {metric: value}`` for ``diversity``.
    blocks: a regex of the ``/``-joined module paths of the model's blocks that gather their own parameters
      (``ipf_jax.models.blocks``; with ``config.fsdp`` each block gathers its share when it runs, under
      ``remat`` never the whole particle at once); default the model's ``BLOCKS`` attribute, else none. Linen
      models only: refused for an NNX model.
    augment: ``(batch, key) -> batch``, a train-time transform of one particle's shard of the batch inside
      the train step, before the model and the loss (``mix``: mixup), with a key per particle and step; or
      ``None``. It may use collectives over ``"data"`` (the particle's other shards).
    augment_takes_position: ``augment`` is ``(batch, key, position) -> batch``, ``position`` the particle's
      place in the population, ``slot / (P - 1)`` in ``[0, 1]`` (a float32 scalar): per-particle regularisation
      (PAPA), e.g. ``classification(label_smoothing_spread=...)``. A slot keeps its strength when resampling
      copies another particle into it.
  """

  model: Any  # nn.Module, or nnx_bridge.NNXModel (made from an NNX module in __post_init__)
  loss: Callable[[Any, dict], jax.Array]
  predictive: Callable[[Any, dict], Any]
  score: Callable[[Any, dict, jax.Array], dict]
  finalize: Callable[[dict], dict]
  columns: tuple = ()
  inputs: Optional[str] = "image"
  rngs: tuple = ()
  diversity: Optional[Callable] = None
  finalize_diversity: Optional[Callable[[dict], dict]] = None
  augment: Optional[Callable[..., dict]] = None
  augment_takes_position: bool = False
  blocks: Optional[str] = None

  def __post_init__(self):
    if self.blocks is None:
      object.__setattr__(self, "blocks", getattr(self.model, "BLOCKS", ""))
    try:
      re.compile(self.blocks)
    except (re.error, TypeError) as error:
      raise ValueError(f"Task.blocks={self.blocks!r} is not a regex of module paths ({error})") from error
    if nnx_bridge.is_nnx(self.model):  # frozen: the adapted model replaces the one given, once
      if self.blocks:
        raise ValueError(
          f"Task.blocks={self.blocks!r}: an NNX model's blocks cannot gather their own parameters "
          "(ipf_jax.models.blocks.make builds Flax linen blocks); leave blocks (and the model's BLOCKS) unset, "
          "and config.fsdp gathers the whole particle"
        )
      object.__setattr__(self, "model", nnx_bridge.NNXModel(self.model))
      object.__setattr__(self, "rngs", self.rngs or self.model.streams)
    if (self.diversity is None) != (self.finalize_diversity is None):
      raise ValueError("Task: diversity and finalize_diversity go together (set both or neither)")

  def apply(self, variables: dict, batch: dict, train: bool, key: Optional[jax.Array] = None):
    """``outputs`` (eval) or ``(outputs, batch_stats)`` (train; ``{}`` without BatchNorm)."""
    x = batch if self.inputs is None else batch[self.inputs]
    rngs = {name: jax.random.fold_in(key, i) for i, name in enumerate(self.rngs)} if key is not None else None
    if not train:
      return self.model.apply(variables, x, train=False, rngs=rngs)
    outputs, new = self.model.apply(variables, x, train=True, rngs=rngs, mutable=["batch_stats"])
    return outputs, new.get("batch_stats", {})

  def init(self, key: jax.Array, batch: dict) -> dict:
    """The model's variables for one example shaped like ``batch``'s first one."""
    example = jax.tree.map(lambda x: jnp.zeros((1,) + x.shape[1:], x.dtype), batch)
    x = example if self.inputs is None else example[self.inputs]
    return self.model.init({"params": key, **{name: key for name in self.rngs}}, x, train=False)


# ---- classification -----------------------------------------------------------------------------------------


def classification(
  model: nn.Module,
  label_smoothing: float = 0.0,
  inputs: str = "image",
  label: str = "label",
  rngs: tuple = (),
  mixup: float = 0.0,
  num_classes: Optional[int] = None,
  label_smoothing_spread: float = 0.0,
  mixup_spread: float = 0.0,
) -> Task:
  """Softmax cross-entropy on integer labels ``[b]`` or soft targets ``[b, C]`` (class probabilities;
  ``label_smoothing`` optional on either); ``mixup > 0``: big_vision's mixup in the train step (``mix``,
  needs ``num_classes``). ``label_smoothing_spread`` or ``mixup_spread`` > 0: per-particle strengths (PAPA,
  ``per_slot``): slot ``i`` of ``P`` trains with ``label_smoothing + spread * i / (P - 1)`` and
  mixup ``mixup + spread * i / (P - 1)``; the loss on other batches (weighing on common examples, syncs) is the
  plain cross-entropy. The ensembles average class probabilities; scored (integer labels) by accuracy,
  NLL, ECE, Brier, selective prediction and tempered NLL / ECE / Brier (``metrics.classification_sums``);
  the population's disagreement and pairwise KL (``metrics.diversity_sums``)."""
  if (mixup or mixup_spread or label_smoothing_spread) and not num_classes:
    raise ValueError("classification(mixup=..., *_spread=...) needs num_classes: they change one-hot targets")
  spread = label_smoothing_spread or mixup_spread
  augment = mix(mixup, num_classes, inputs, label) if mixup else None
  if spread:
    augment = per_slot(label_smoothing, label_smoothing_spread, mixup, mixup_spread, num_classes, inputs, label)
    label_smoothing = 0.0  # applied to the particle's targets in the step; other batches score plain

  def loss(logits, batch):
    y = batch[label]
    if y.ndim < logits.ndim and not label_smoothing:
      return optax.softmax_cross_entropy_with_integer_labels(logits, y)
    targets = y if y.ndim == logits.ndim else jax.nn.one_hot(y, logits.shape[-1])
    if label_smoothing:
      targets = optax.smooth_labels(targets, label_smoothing)
    return optax.softmax_cross_entropy(logits, targets)

  return Task(
    model=model,
    loss=loss,
    predictive=lambda logits, batch: jax.nn.softmax(logits),
    score=lambda probs, batch, mask: metrics_lib.classification_sums(probs, batch[label], mask),
    finalize=metrics_lib.finalize,
    inputs=inputs,
    rngs=rngs,
    diversity=metrics_lib.diversity_sums,
    finalize_diversity=metrics_lib.finalize_diversity,
    augment=augment,
    augment_takes_position=bool(spread),
    columns=(
      ("accuracy", "accuracy", "{:.2%}"),
      ("NLL", "nll", "{:.4f}"),
      ("ECE", "ece", "{:.4f}"),
      ("Brier", "brier", "{:.4f}"),
    ),
  )


def per_slot(
  smoothing: float, smoothing_spread: float, mixup: float, mixup_spread: float, num_classes: int,
  inputs: str = "image", label: str = "label",
) -> Callable:  # fmt: skip
  """PAPA's per-member regularisation as a position-aware ``Task.augment``: the particle at position ``f`` (slot
  ``i`` of ``P``: ``i / (P - 1)``) mixes its batch with concentration ``mixup + mixup_spread * f`` (none at 0)
  and smooths its targets by ``smoothing + smoothing_spread * f``; the targets leave soft ``[b, C]``."""

  def augment(batch: dict, key: jax.Array, f: jax.Array) -> dict:
    if mixup or mixup_spread:
      mixed = mix(jnp.maximum(mixup + mixup_spread * f, 1e-3), num_classes, inputs, label)(batch, key)
      y = batch[label]
      plain = {**batch, label: y.astype(jnp.float32) if y.ndim > 1 else jax.nn.one_hot(y, num_classes)}
      batch = jax.tree.map(lambda m, b: jnp.where(mixup + mixup_spread * f > 0, m, b), mixed, plain)
    y = batch[label]
    targets = y.astype(jnp.float32) if y.ndim > 1 else jax.nn.one_hot(y, num_classes)
    return {**batch, label: optax.smooth_labels(targets, smoothing + smoothing_spread * f)}

  return augment


def mix(p: float, num_classes: int, inputs: str = "image", label: str = "label") -> Callable:
  """big_vision's mixup (``utils.mixup``, n = 2) as a ``Task.augment``: one ratio ``r ~ Dirichlet(p, p)``
  per particle and step, sorted so that ``r_0 >= r_1`` (an example keeps the larger share), and each of
  the particle's examples mixed with the one before it, ``x_j <- r_0 x_j + r_1 x_{j-1}`` (``x_0`` with the
  last), its targets alike (integer labels as one-hot, soft ones as they are). "The one before" runs over
  the particle's whole batch, across its data shards (one example moves between neighbouring shards,
  ``ppermute`` over ``"data"``), so a particle's mixed batch does not depend on the mesh."""

  def augment(batch: dict, key: jax.Array) -> dict:
    r = jnp.sort(jax.random.dirichlet(key, jnp.full((2,), p, jnp.float32)))[::-1]  # r_0 >= r_1, as big_vision
    y = batch[label]
    targets = y.astype(jnp.float32) if y.ndim > 1 else jax.nn.one_hot(y, num_classes)

    def blend(x):
      return (r[0] * x + r[1] * roll_over_data(x)).astype(x.dtype)

    return {**batch, inputs: blend(batch[inputs]), label: blend(targets)}

  return augment


def roll_over_data(x: jax.Array) -> jax.Array:
  """``x`` (this device's shard of a particle's examples) as its part of the whole batch rolled by one
  along the examples (``out_j = x_{j-1}``): the previous ``"data"`` shard's last example comes first."""
  n = lax.axis_size(DATA)
  last = x[-1:]
  if n > 1:
    last = lax.ppermute(last, DATA, [(d, (d + 1) % n) for d in range(n)])
  return jnp.concatenate([last, x[:-1]], axis=0)


# ---- regression ----------------------------------------------------------------------------------------------


def gaussian_regression(model: nn.Module, inputs: str = "x", target: str = "y", rngs: tuple = ()) -> Task:
  """A Gaussian likelihood: the model outputs ``[b, 2]`` = (mean, raw scale) with
  ``sigma = softplus(raw) + 1e-3``; the loss is the Gaussian negative log-likelihood of ``batch[target]``.
  The ensembles are mixtures of Gaussians: they mix the density of the target (in log space) and
  average the first two moments; scored by NLL and RMSE of the mean (``metrics.regression_sums``)."""

  def split(outputs):
    return outputs[..., 0], jax.nn.softplus(outputs[..., 1]) + 1e-3

  def loss(outputs, batch):
    mean, sigma = split(outputs)
    return metrics_lib.gaussian_nll(batch[target], mean, sigma)

  def predictive(outputs, batch):
    mean, sigma = split(outputs)
    return {
      "log_density": -metrics_lib.gaussian_nll(batch[target], mean, sigma),
      "mean": mean,
      "second_moment": sigma**2 + mean**2,
    }

  return Task(
    model=model,
    loss=loss,
    predictive=predictive,
    score=lambda pred, batch, mask: metrics_lib.regression_sums(pred, batch[target], mask),
    finalize=metrics_lib.finalize_regression,
    inputs=inputs,
    rngs=rngs,
    columns=(("NLL", "nll", "{:.4f}"), ("RMSE", "rmse", "{:.4f}")),
  )

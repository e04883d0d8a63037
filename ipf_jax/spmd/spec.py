"""The particle filter's static settings: what the train step is compiled for."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParticleSpec:
  """The particle filter's static settings (DESIGN.md §3), resolved from the mode. Keyword-only, and each
  field named as the config field it comes from (``defaults.py`` says what it means); ``shared_init`` and
  ``resampling`` are derived."""

  num_particles: int
  temperature: float = 0.0
  forgetting: float = 1.0
  correction: float = 0.0
  ess_threshold: float = 0.0
  resample_every: int = 0
  jitter: float = 0.0
  shared_init: bool = True  # one init for all particles (config.init, resolved with the mode)
  resampling: bool = False  # whether the step has the resampling branch at all (ipf mode, P > 1)
  compress_correction: bool = False
  elastic_pull: float = 0.0
  elastic_pull_every: int = 1  # the pull on every k-th step only (a gentle pull, PAPA)
  particle_loop: str = "vmap"  # resolved: vmap | map | unroll
  resample_exchange: str = "auto"  # all_to_all | rounds | auto (population.exchange.choose_exchange)
  resample_placement: str = "ascending"  # ascending | local (population.particle_filter.place_local)
  weigh_on: str = "own"
  common_examples: int = 2
  ess_target: float = 0.0
  jitter_lr: float = 0.0
  grad_accum_steps: int = 1
  fsdp_gather: str = "particle"  # particle | block (models.blocks: each block gathers its own)
  islands: int = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class OuterSpec:
  """The outer loop's static settings (DESIGN.md §3b; ``None`` for the per-step filter), each named as its config
  field. Between syncs every particle takes plain optimizer steps; at a sync the filter weighs (at
  ``sync_temperature``), averages, updates the anchor and resamples (``ParticleSpec``'s forgetting, ess_target,
  ess_threshold, islands, jitter), then pulls every particle towards the anchor."""

  sync: str  # every | qsr | swap (population.outer.sync_steps)
  sync_every: int = 8  # every: H; qsr: H_base
  sync_qsr_alpha: float = 0.25  # qsr: alpha of H = max(H_base, floor((alpha peak_lr / lr)^2))
  sync_swap_fraction: float = 0.5  # swap: the fraction of the run synchronised every step
  sync_pull: float = 1.0  # gamma: theta_i <- theta_i + gamma (A - theta_i)
  sync_temperature: float = 0.0  # tau at a sync (0: the uniform mean)
  sync_examples: int = 32  # examples of each particle's part of the batch that every particle is weighed on
  sync_opt_state: str = "keep"  # keep | reset | average: each particle's optimizer state at a sync
  outer_lr: float = 1.0  # the anchor's outer SGD
  outer_momentum: float = 0.0  # its Nesterov momentum (0: none; DiLoCo: 0.9 with outer_lr 0.7)

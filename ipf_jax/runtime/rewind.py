"""Rewind on divergence (``config.rewind``, docs/RUNNING.md "Rewind on divergence"): when the training loss's
moving average stays above ``rewind_loss_factor`` times its lowest value for ``rewind_window`` steps, or the periodic
evaluation's accuracy falls more than ``rewind_accuracy_drop`` points below the run's best, the run goes back to
its newest checkpoint (periodic saves are held while the loss is suspect, so that one predates the spike),
skips the batches it trained on since, and goes on; after ``rewind_max`` rewinds it stops (``DivergedError``).

The decision is made from numbers every process holds alike (the step's replicated loss, the evaluation's
accuracy), so every process of a multi-host run rewinds at the same step. The count and the data offset (the
batches skipped in all) are saved in each checkpoint's metadata, so a resumed run reads on where it was
(PaLM's practice, Chowdhery et al. 2022 §5.1, automated: restart before the spike, skip the batches)."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional


class DivergedError(FloatingPointError):
  """The run diverged again after ``rewind_max`` rewinds (or had no checkpoint to go back to)."""


class Rewind(Exception):
  """Raised inside the step loop when a rewind is due; ``reason`` says why, in words."""

  def __init__(self, step: int, reason: str):
    super().__init__(reason)
    self.step, self.reason = step, reason


@dataclasses.dataclass
class Watch:
  """The host-side watch over one run, resumed from the checkpoint's record (``record``). ``enabled`` False: a
  run with ``rewind`` off that resumes a rewound run's checkpoint keeps reading the data at its offset and keeps
  the record, and judges nothing."""

  window: int
  loss_factor: float
  accuracy_drop: float  # points; 0: the evaluation does not trigger
  count: int = 0
  data_offset: int = 0  # batches skipped in all: step k reads the data at position k + data_offset
  average: Optional[float] = None
  lowest: float = math.inf
  above: int = 0  # consecutive steps with the average above loss_factor x lowest
  best_accuracy: float = -math.inf
  enabled: bool = True
  last_nonfinite: bool = False
  lr_factor: float = 1.0  # config.rewind_lr_factor: the learning rate times this at each rewind
  lr_scale: float = 1.0  # the learning rate's factor now: the product of the factors of the rewinds so far

  @classmethod
  def from_config(cls, config, saved: Optional[dict] = None) -> Optional["Watch"]:
    """The watch ``config.rewind`` asks for, resumed from a checkpoint's ``rewind`` record; ``None``: rewind
    off and no record (a disabled watch keeps a record's data offset)."""
    if not config.rewind and not saved:
      return None
    saved = saved or {}
    lowest, best = saved.get("lowest"), saved.get("best_accuracy")
    return cls(
      window=config.rewind_window,
      loss_factor=config.rewind_loss_factor,
      accuracy_drop=config.rewind_accuracy_drop,
      count=int(saved.get("count", 0)),
      data_offset=int(saved.get("data_offset", 0)),
      average=saved.get("average"),
      lowest=math.inf if lowest is None else float(lowest),
      above=int(saved.get("above", 0)),
      best_accuracy=-math.inf if best is None else float(best),
      enabled=bool(config.rewind),
      lr_factor=float(config.rewind_lr_factor),
      lr_scale=float(saved.get("lr_scale", 1.0)),  # saved, so a resume with another factor changes later rewinds only
    )

  @property
  def suspect(self) -> bool:
    """The loss is above the line: periodic saves wait, so the newest checkpoint stays one from before."""
    return self.enabled and self.above > 0

  def record(self) -> dict:
    """What a checkpoint keeps of the watch: the count, the data offset, the learning rate's factor and the loss's
    statistics (a run stopped inside a spike judges it on when resumed)."""
    finite = lambda x: None if x is None or not math.isfinite(x) else float(x)
    return {
      "count": self.count,
      "data_offset": self.data_offset,
      "lr_scale": self.lr_scale,
      "average": finite(self.average),
      "lowest": finite(self.lowest),
      "above": self.above,
      "best_accuracy": finite(self.best_accuracy),
    }

  def loss(self, step: int, value: float) -> None:
    """One step's training loss (non-finite: every particle dead or skipped); raises ``Rewind`` when the spike
    has lasted ``window`` steps."""
    if not self.enabled:
      return
    if not math.isfinite(value):
      self.above, self.last_nonfinite = self.above + 1, True
    else:
      self.last_nonfinite = False
      decay = 1.0 - 1.0 / self.window
      self.average = value if self.average is None else decay * self.average + (1.0 - decay) * value
      self.lowest = min(self.lowest, self.average)
      self.above = self.above + 1 if self.average > self.loss_factor * self.lowest else 0
    if self.above >= self.window:
      if self.last_nonfinite:
        raise Rewind(step, f"the training loss was not finite (or every particle was skipped) for {self.window} steps")
      raise Rewind(
        step,
        f"the training loss's moving average ({self.average:.4g}) stayed above {self.loss_factor:g} x its lowest "
        f"({self.lowest:.4g}) for {self.window} steps",
      )

  def accuracy(self, step: int, value: float) -> None:
    """The periodic evaluation's accuracy (a fraction); raises ``Rewind`` on a drop of ``accuracy_drop`` points."""
    if not self.enabled:
      return
    if self.accuracy_drop and 100 * (self.best_accuracy - value) > self.accuracy_drop:
      raise Rewind(
        step,
        f"the evaluation's accuracy ({100 * value:.2f}%) fell more than {self.accuracy_drop:g} points below the "
        f"run's best ({100 * self.best_accuracy:.2f}%)",
      )
    self.best_accuracy = max(self.best_accuracy, value)

  def rewound(self, from_step: int, to_step: int, max_rewinds: int) -> None:
    """Counts a rewind from ``from_step`` back to ``to_step`` (the batches between are skipped), or raises
    ``DivergedError`` past ``max_rewinds``. The loss's history starts again after the restore."""
    if self.count >= max_rewinds:
      raise DivergedError(
        f"step {from_step}: the run diverged again after {self.count} rewind(s) (config.rewind_max="
        f"{max_rewinds}). Lower config.base_lr or set config.grad_clip_norm, then resume: the newest checkpoint "
        f"(step {to_step}) is kept."
      )
    self.count += 1
    self.lr_scale *= self.lr_factor
    self.data_offset += from_step - to_step
    self.average, self.above = None, 0

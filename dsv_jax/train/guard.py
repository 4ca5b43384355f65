"""The divergence guard: which training steps are bad, whether the state may be saved, when to stop.

A step is bad when its loss or gradient is not finite (the train step skipped its update) or when
its loss is above `train.divergence_factor` x the median of the last `train.divergence_window` good
losses: weights that are finite but garbage (a learning rate far too high) show up as a loss many
orders of magnitude above its history. While the latest step is bad no checkpoint or sample is
written; after `train.max_bad_steps` bad steps in a row the run stops with TrainingDiverged.

The loss of step t is computed from the parameters after step t - 1, so it is also the verdict on
a checkpoint saved at step t - 1 (see Checkpointer.judge).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
from typing import Iterable

import numpy as np

from dsv_jax.config import TrainConfig

log = logging.getLogger("dsv_jax")


def non_finite_part(loss: float, grad_norm: float | None = None) -> str:
    """What made a step skip its update: the loss, else the gradient (`grad_norm`), else the DSV
    predictor's loss or gradient (the train step's `finite` covers all three)."""
    if not math.isfinite(loss):
        return "non-finite loss"
    if grad_norm is None:
        return "non-finite gradient or DSV predictor loss"
    if not math.isfinite(grad_norm):
        return "non-finite gradient"
    return "non-finite DSV predictor loss or gradient"


class TrainingDiverged(RuntimeError):
    """Training stopped on bad steps; the message says which and where the last good checkpoint is."""


@dataclasses.dataclass(frozen=True)
class Verdict:
    step: int
    loss: float
    bad: str | None = None  # None (good), "skipped" (non-finite) or "diverged"
    reason: str = ""


class DivergenceGuard:
    def __init__(self, train: TrainConfig, history: Iterable[float] = ()):
        """`history`: good losses of earlier steps (a resumed run's metrics), oldest first."""
        self.max_bad, self.factor = train.max_bad_steps, train.divergence_factor
        self._good: collections.deque[float] = collections.deque(
            (x for x in history if math.isfinite(x)), maxlen=train.divergence_window
        )
        self.streak = 0  # bad steps in a row
        self.last: Verdict | None = None

    def observe(self, step: int, loss: float, finite: bool, grad_norm: float | None = None) -> Verdict:
        """`finite`: the train step's verdict (loss, gradient and DSV predictor all finite; else it skipped
        its update); `grad_norm` says which part was not."""
        loss = float(loss)
        median = float(np.median(self._good)) if self.factor and self._good else None
        diverged = median is not None and math.isfinite(loss) and loss > self.factor * median
        if not (finite and math.isfinite(loss)):
            what = non_finite_part(loss, grad_norm)
            if diverged:  # a huge but finite loss whose gradient overflowed: a finite loss is not non-finite
                reason = f"diverged: loss {loss:.4g} > {self.factor:g} x the running median {median:.4g}, with a {what}"
            elif math.isfinite(loss):
                reason = f"{what} (the loss {loss:.4g} is finite)"
            else:
                reason = f"{what} ({loss})"
            verdict = Verdict(step, loss, "skipped", f"{reason}, update skipped")
        elif diverged:
            verdict = Verdict(
                step, loss, "diverged", f"diverged: loss {loss:.4g} > {self.factor:g} x the running median {median:.4g}"
            )
            log.warning("step %d: %s", step, verdict.reason)
        else:
            verdict = Verdict(step, loss)
            self._good.append(loss)
        self.streak = self.streak + 1 if verdict.bad else 0
        self.last = verdict
        return verdict

    @property
    def healthy(self) -> bool:
        """The latest step was good (or none ran yet): its state may be saved and sampled."""
        return self.last is None or self.last.bad is None

    @property
    def should_stop(self) -> bool:
        return bool(self.max_bad) and self.streak >= self.max_bad

    def error(self, last_good: int | None) -> TrainingDiverged:
        """The exception a run ends with while unhealthy, naming the cause and the checkpoint to go back to."""
        v = self.last
        where = (
            f"the last good checkpoint is step {last_good}, where a rerun resumes (lower train.lr first?)"
            if last_good is not None
            else "no good checkpoint was saved"
        )
        what = f"{self.streak} bad step(s) in a row" if self.should_stop else "the last step was bad"
        return TrainingDiverged(f"training stopped at step {v.step}: {what}, last {v.reason}; {where}")

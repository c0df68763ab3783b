"""The best policy so far by a held-out metric, and when to stop because it no longer improves.

The last step is not the best one when the policy over-optimises its reward: a reward model's
score keeps rising while the answers get worse (issue 31). Keeping the best evaluation's policy
next to the latest, and stopping after `patience` evaluations without improvement, is what HF's
Trainer (metric_for_best_model, EarlyStoppingCallback) and NeMo-RL (checkpointing.metric_name)
offer. The trainer owns the export; this class only decides, from metrics that are identical on
every rank, so every rank decides the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mcore_rl.config.trainer import ModelSelectionConfig


@dataclass(frozen=True)
class Verdict:
    """What one evaluation means for the run."""

    improved: bool
    """It is the best so far (export it)."""

    stop: bool
    """Training should end here."""


class ModelSelection:
    """Tracks the best value of `config.metric` over the run's evaluations."""

    def __init__(self, config: ModelSelectionConfig):
        self.config = config
        self.best_value: float | None = None
        self.best_step: int | None = None
        self.evaluations_without_improvement = 0

    @property
    def enabled(self) -> bool:
        return self.config.metric is not None

    @property
    def stopped(self) -> bool:
        """Whether the run has stopped early (also after a resume)."""
        return bool(self.config.patience) and (
            self.evaluations_without_improvement >= self.config.patience)

    def observe(self, step: int, metrics: dict) -> Verdict:
        """Record the evaluation at `step`; a metric the evaluation did not log is an error
        (naming what it did log), a value that is not finite counts as no improvement."""
        if not self.enabled:
            return Verdict(False, False)
        name = self.config.metric
        if name not in metrics:
            raise KeyError(f"trainer.selection.metric={name!r} is not among the evaluation's "
                           f"metrics: {sorted(metrics)}")
        value = float(metrics[name])
        if not math.isfinite(value):
            return self._no_improvement()
        sign = 1.0 if self.config.higher_is_better else -1.0
        if self.best_value is None or sign * (value - self.best_value) > self.config.min_delta:
            self.best_value, self.best_step = value, step
            self.evaluations_without_improvement = 0
            return Verdict(True, False)
        return self._no_improvement()

    def _no_improvement(self) -> Verdict:
        self.evaluations_without_improvement += 1
        return Verdict(False, self.stopped)

    def summary(self) -> dict:
        """What hf/best.json records."""
        return {"metric": self.config.metric, "value": self.best_value, "step": self.best_step,
                "higher_is_better": self.config.higher_is_better}

    def state_dict(self) -> dict:
        return {"best_value": self.best_value, "best_step": self.best_step,
                "evaluations_without_improvement": self.evaluations_without_improvement}

    def load_state_dict(self, state: dict) -> None:
        self.best_value, self.best_step = state["best_value"], state["best_step"]
        self.evaluations_without_improvement = state["evaluations_without_improvement"]

"""What stops a run that goes on training on nothing: consecutive steps whose updates were
skipped (non-finite losses or gradients), and consecutive steps in which every sample's reward
was an error (a reward function that cannot load, read its files or reach its service in the
sandbox scores 0 on every sample: without this the run would train on zero advantages for
ever, its gradient norm 0)."""

from __future__ import annotations

import math

from mcore_rl.runtime import print0


class TrainingDiverged(RuntimeError):
    """Too many consecutive steps with non-finite losses or gradients."""


class RewardsFailed(RuntimeError):
    """Too many consecutive steps in which every reward was an error."""


def is_bad_step(metrics: dict) -> bool:
    """A step whose update was skipped or whose losses or gradient norms are not finite."""
    return metrics["training/update_skipped"] > 0 or not all(
        math.isfinite(value) for name, value in metrics.items()
        if name.endswith(("/loss", "/grad_norm")))


class StepGuards:
    """Counts the consecutive bad steps and failed-reward steps; raises past their limits."""

    def __init__(self, max_bad_steps: int, max_failed_reward_steps: int, checkpoint_dir: str):
        self.max_bad_steps = max_bad_steps
        self.max_failed_reward_steps = max_failed_reward_steps
        self.checkpoint_dir = checkpoint_dir
        self.bad_steps = 0
        """Consecutive steps whose update was skipped (saved with checkpoints)."""
        self.failed_reward_steps = 0

    def state_dict(self) -> int:
        """What a checkpoint keeps: the count of consecutive bad steps (a number, as checkpoints
        have always stored it)."""
        return self.bad_steps

    def load_state_dict(self, bad_steps: int) -> None:
        self.bad_steps = bad_steps

    def check(self, step: int, metrics: dict) -> None:
        """After step `step`'s update, with its metrics (identical on every rank)."""
        bad = is_bad_step(metrics)
        self.bad_steps = self.bad_steps + 1 if bad else 0
        if bad:
            print0(f"step {step}: update skipped (non-finite loss or gradient norm), "
                   f"{self.bad_steps} in a row")
        if self.bad_steps >= self.max_bad_steps:
            raise TrainingDiverged(
                f"{self.bad_steps} consecutive steps with non-finite losses or gradients "
                f"(trainer.max_bad_steps={self.max_bad_steps}); the newest checkpoint in "
                f"{self.checkpoint_dir} is from before them")
        failed = metrics.get("reward/error_fraction") == 1.0
        self.failed_reward_steps = self.failed_reward_steps + 1 if failed else 0
        if self.max_failed_reward_steps and \
                self.failed_reward_steps >= self.max_failed_reward_steps:
            raise RewardsFailed(
                f"every sample's reward was an error in {self.failed_reward_steps} consecutive "
                f"steps (reward.max_failed_steps={self.max_failed_reward_steps}): the "
                "'reward 0 for sample' lines of the scoring ranks say why and which reward.* "
                "setting would allow it")

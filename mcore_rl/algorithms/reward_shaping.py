"""What the policy is trained on, made from the scorer's scores: cut-off responses penalised,
centred, normalised, clipped.

A learned reward model's scores have an arbitrary offset and scale, and the policy will push
them wherever the model is wrong. The safeguards RLHF systems apply before the advantage:

- a penalty for responses cut off at max_new_tokens without their end-of-sequence token (TRL's
  `missing_eos_penalty`): a reward model has only seen complete answers, and reads a cut-off
  one at a token it was never trained to score there. On the quickstart's pairs PPO found
  exactly that: "9 9" and "8 9", two digits and no <eos>, scored above every complete answer;
- centring on the starting policy (InstructGPT, Ouyang et al. 2022, sec. 3.5: the reward model
  gets a bias so that the SFT policy's answers score 0 on average): the bias is the mean score
  of the first step's responses, which the starting policy sampled, kept for the whole run;
- running normalisation (TRL's PPO `use_score_scaling` / `use_score_norm`, OpenRLHF's
  `--normalize_reward`): each step's scores update running moments of every score seen so
  far, then are divided by the running std ("scale") or standardised ("standardize");
- clipping to [-clip, clip] (TRL's `score_clip`, OpenRLHF's `--reward_clip_range`).

The moments are over the global batch (all data-parallel ranks), so a step is the same at any
DP size, and they are checkpointed, so a resumed run shapes as an uninterrupted one would.
"""

from __future__ import annotations

import torch

from mcore_rl.config.reward import RewardShapingConfig

from .statistics import masked_sum_count


class RewardShaper:
    """Scores -> training rewards, with the running state (bias and moments) of one run."""

    def __init__(self, config: RewardShapingConfig, epsilon: float = 1e-8):
        self.config = config
        self.epsilon = epsilon
        self.bias: float | None = None
        """The starting policy's mean score (center), set on the first step."""
        self.count = 0.0
        self.mean = 0.0
        self.variance = 0.0
        """Running moments of every (centred) score seen: count, mean, population variance."""

    def __call__(self, scores: torch.Tensor, truncated: torch.Tensor, group=None
                 ) -> tuple[torch.Tensor, dict]:
        """The training rewards of this rank's `scores` [n] (`truncated` [n]: the responses
        that hit max_new_tokens) and the step's numbers (identical on every rank of `group`,
        the data-parallel group)."""
        config = self.config
        if not config.active:
            return scores, {}
        ones = torch.ones_like(scores)
        total, squares, count = masked_sum_count(scores, ones, group)
        metrics = {"reward/raw_mean": float(total / count.clamp(min=1))}
        if config.missing_eos_penalty:
            scores = scores - config.missing_eos_penalty * truncated.to(scores.dtype)
            total, squares, count = masked_sum_count(scores, ones, group)
        if config.center:
            if self.bias is None:
                self.bias = float(total / count.clamp(min=1))
            scores = scores - self.bias
            total, squares = total - count * self.bias, _shifted_squares(squares, total, count,
                                                                         self.bias)
            metrics["reward/center"] = self.bias
        if config.normalize != "none":
            self._update_moments(float(total), float(squares), float(count))
            std = self._running_std()
            if config.normalize == "standardize":
                scores = scores - self.mean
            scores = scores / (std + self.epsilon)
            metrics.update({"reward/running_mean": self.mean, "reward/running_std": std})
        if config.clip is not None:
            clipped = (scores.abs() > config.clip).double()
            metrics["reward/clipped_fraction"] = float(
                masked_sum_count(clipped, ones, group)[0] / count)
            scores = scores.clamp(-config.clip, config.clip)
        return scores, metrics

    def _update_moments(self, total: float, squares: float, count: float) -> None:
        """Merge a batch's sums into the running moments (Chan et al.'s parallel variance)."""
        if count == 0:
            return
        batch_mean = total / count
        batch_variance = max(squares / count - batch_mean ** 2, 0.0)
        merged = self.count + count
        delta = batch_mean - self.mean
        self.variance = (self.variance * self.count + batch_variance * count
                         + delta ** 2 * self.count * count / merged) / merged
        self.mean += delta * count / merged
        self.count = merged

    def _running_std(self) -> float:
        """The unbiased std of every score seen (1 until there are two)."""
        if self.count < 2:
            return 1.0
        return (self.variance * self.count / (self.count - 1)) ** 0.5

    def state_dict(self) -> dict:
        return {"bias": self.bias, "count": self.count, "mean": self.mean,
                "variance": self.variance}

    def load_state_dict(self, state: dict) -> None:
        self.bias, self.count = state["bias"], state["count"]
        self.mean, self.variance = state["mean"], state["variance"]


def _shifted_squares(squares, total, count, bias: float):
    """Sum of (x - bias)^2 from the sums of x and x^2."""
    return squares - 2 * bias * total + count * bias * bias

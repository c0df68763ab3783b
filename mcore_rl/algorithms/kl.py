"""KL estimators between the policy and the reference, and the KL controllers.

Per-token estimators of KL(pi || pi_ref) from samples of pi, with delta = logp - logp_ref
(Schulman, "Approximating KL divergence", 2020; verl's `kl_penalty`):
  k1   delta                      unbiased, high variance, can be negative
  k2   delta^2 / 2                biased, low variance
  k3   exp(-delta) + delta - 1    unbiased, low variance, >= 0; computed with -delta clamped to
                                  [-20, 20] and the result clamped to [-10, 10]
  abs  |delta|
In the reward (`use_kl_in_reward`), the penalty kl_coef x estimate is subtracted from each token's
reward and the controller adapts kl_coef; as a loss (`use_kl_loss`) it is added to the policy
loss.
"""

from __future__ import annotations

import torch

from .statistics import masked_sum_count


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str):
    """Per-token KL estimate [b, s]."""
    delta = logprobs - ref_logprobs
    if estimator == "k1":
        return delta
    if estimator == "k2":
        return 0.5 * delta.square()
    if estimator == "abs":
        return delta.abs()
    if estimator == "k3":
        reverse = (-delta).clamp(-20, 20)
        return (reverse.exp() - reverse - 1).clamp(-10, 10)
    raise ValueError(f"unknown KL estimator {estimator!r}; known: k1, k2, k3, abs")


class KLController:
    """The KL coefficient: fixed, or adaptive (Ziegler et al. 2019): after each batch,
    coef *= 1 + clip(KL / target - 1, -0.2, 0.2) x samples / horizon."""

    def __init__(self, coef: float, adaptive: bool = False, target_kl: float = 0.1,
                 horizon: int = 10000):
        self.value = coef
        self.adaptive = adaptive
        self.target_kl = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, samples: int) -> None:
        if self.adaptive:
            error = min(max(current_kl / self.target_kl - 1, -0.2), 0.2)
            self.value *= 1 + error * samples / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def apply_kl_penalty(token_rewards, logprobs, ref_logprobs, mask, controller: KLController,
                     estimator: str, group=None):
    """(token rewards - coef x KL on response tokens, the batch's mean per-sequence KL). The
    controller is then updated with that KL and the global number of sequences."""
    penalty = kl_estimate(logprobs, ref_logprobs, estimator) * mask
    per_sequence = penalty.sum(-1) / mask.sum(-1).clamp(min=1)
    total, _, sequences = masked_sum_count(per_sequence, torch.ones_like(per_sequence), group)
    current_kl = float(total / sequences.clamp(min=1))
    rewards = token_rewards - controller.value * penalty
    controller.update(current_kl, int(sequences))
    return rewards, current_kl

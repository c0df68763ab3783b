"""Advantage estimators (verl's definitions; `ADVANTAGE_ESTIMATORS` by name).

Every estimator maps `AdvantageInputs` ([b, s] tensors over prompt+response rows, response tokens
marked by `response_mask`) to (advantages, returns), both [b, s] and zero outside the response.
Outcome rewards sit on a response's last token in `token_rewards`; a sample's score is the sum.
Groups (`group_ids`: the prompt each sample answers) must be whole on the rank: the engine returns
all n samples of a prompt to the rank that owns it. Whitening uses the global batch over the
data-parallel `group`.

  gae                           delta_t = r_t + gamma V_{t+1} - V_t,  A_t = sum_l (gamma lam)^l
                                delta_{t+l} over response tokens; returns = A + V; A whitened
                                (Schulman et al. 2016).
  grpo                          A = (score - mean_group) / (std_group + eps), unbiased std; a
                                group of one has mean 0, std 1 (Shao et al. 2024); without std:
                                Dr. GRPO (Liu et al. 2025).
  rloo                          A = n/(n-1) (score - mean_group) = score - mean of the others
                                (Ahmadian et al. 2024); a group of one keeps its score.
  reinforce_plus_plus           discounted return-to-go, reset outside the response, whitened
                                (Hu 2025).
  reinforce_plus_plus_baseline  score - group mean on every response token, whitened.
  remax                         return-to-go minus the greedy response's reward (Li et al. 2023).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from mcore_rl.config.algorithm import AlgorithmConfig

from .registry import Registry
from .statistics import masked_whiten


@dataclass
class AdvantageInputs:
    """What the estimators read; fields an estimator does not need may be None."""

    token_rewards: torch.Tensor
    """[b, s] reward of each token (outcome reward on the last response token, KL penalty per
    token when it is in the reward)."""

    response_mask: torch.Tensor
    """[b, s] 1 on response tokens."""

    group_ids: Optional[torch.Tensor] = None
    """[b] the prompt each sample answers (grpo, rloo, reinforce_plus_plus_baseline)."""

    values: Optional[torch.Tensor] = None
    """[b, s] critic values (gae)."""

    reward_baselines: Optional[torch.Tensor] = None
    """[b] reward of the greedy response to the same prompt (remax)."""


Estimator = Callable[[AdvantageInputs, AlgorithmConfig, object], tuple]
ADVANTAGE_ESTIMATORS: Registry[Estimator] = Registry("advantage estimator")


def compute_advantages(inputs: AdvantageInputs, config: AlgorithmConfig, group=None):
    """(advantages, returns) by `config.estimator`; `group`: the data-parallel group."""
    return ADVANTAGE_ESTIMATORS.get(config.estimator)(inputs, config, group)


def _required(inputs: AdvantageInputs, field: str, estimator: str) -> torch.Tensor:
    value = getattr(inputs, field)
    if value is None:
        raise ValueError(f"advantage estimator {estimator!r} needs inputs.{field}")
    return value


def _group_statistics(scores: torch.Tensor, group_ids: torch.Tensor):
    """Per-sample (group size, group mean, unbiased group std; std 1 for groups of one)."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    scores = scores.double()
    sums = torch.zeros(len(counts), dtype=torch.float64, device=scores.device).index_add_(
        0, inverse, scores)
    means = sums / counts
    squares = torch.zeros_like(sums).index_add_(0, inverse, (scores - means[inverse]) ** 2)
    stds = torch.where(counts > 1, (squares / (counts - 1).clamp(min=1)).sqrt(),
                       torch.ones_like(sums))
    means = torch.where(counts > 1, means, torch.zeros_like(means))
    return counts[inverse], means[inverse], stds[inverse]


def _scores(inputs: AdvantageInputs) -> torch.Tensor:
    return (inputs.token_rewards * inputs.response_mask).sum(dim=-1)


def _on_response(per_sample: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return per_sample.unsqueeze(-1).to(torch.float32) * mask


@ADVANTAGE_ESTIMATORS.register("gae")
def gae(inputs: AdvantageInputs, config: AlgorithmConfig, group=None):
    values = _required(inputs, "values", "gae").float()
    rewards, mask = inputs.token_rewards.float(), inputs.response_mask.float()
    next_value = torch.zeros_like(values[:, 0])
    running = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + config.gamma * next_value - values[:, t]
        candidate = delta + config.gamma * config.lam * running
        # Positions outside the response are skipped: the recursion carries through them.
        next_value = torch.where(mask[:, t] > 0, values[:, t], next_value)
        running = torch.where(mask[:, t] > 0, candidate, running)
        advantages[:, t] = running
    returns = (advantages + values) * mask
    return masked_whiten(advantages, mask, group) * mask, returns


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo(inputs: AdvantageInputs, config: AlgorithmConfig, group=None):
    scores = _scores(inputs)
    _, means, stds = _group_statistics(scores, _required(inputs, "group_ids", "grpo"))
    advantages = scores.double() - means
    if config.norm_adv_by_std_in_grpo:
        advantages = advantages / (stds + config.epsilon)
    advantages = _on_response(advantages, inputs.response_mask)
    return advantages, advantages


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo(inputs: AdvantageInputs, config: AlgorithmConfig, group=None):
    scores = _scores(inputs).double()
    counts, means, _ = _group_statistics(scores, _required(inputs, "group_ids", "rloo"))
    scale = counts / (counts - 1).clamp(min=1)
    advantages = torch.where(counts > 1, (scores - means) * scale, scores)
    advantages = _on_response(advantages, inputs.response_mask)
    return advantages, advantages


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus")
def reinforce_plus_plus(inputs: AdvantageInputs, config: AlgorithmConfig, group=None):
    rewards, mask = inputs.token_rewards.float(), inputs.response_mask.float()
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        # Positions outside the response (padding, a multi-turn episode's observations) pass
        # the return of the next sampled token through unchanged and undiscounted.
        running = torch.where(mask[:, t] > 0, rewards[:, t] + config.gamma * running, running)
        returns[:, t] = running
    return masked_whiten(returns, mask, group) * mask, returns * mask


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(inputs: AdvantageInputs, config: AlgorithmConfig, group=None):
    scores = _scores(inputs).double()
    _, means, _ = _group_statistics(
        scores, _required(inputs, "group_ids", "reinforce_plus_plus_baseline"))
    mask = inputs.response_mask.float()
    centred = _on_response(scores - means, mask)
    advantages = masked_whiten(centred, mask, group) * mask
    return advantages, advantages


@ADVANTAGE_ESTIMATORS.register("remax")
def remax(inputs: AdvantageInputs, config: AlgorithmConfig, group=None):
    baselines = _required(inputs, "reward_baselines", "remax").float()
    mask = inputs.response_mask.float()
    masked = inputs.token_rewards.float() * mask
    returns = masked.flip(-1).cumsum(-1).flip(-1) * mask
    return returns - baselines.unsqueeze(-1) * mask, returns

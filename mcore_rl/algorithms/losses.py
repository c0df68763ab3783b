"""Policy and value losses as per-token loss matrices (verl's definitions), and their
aggregation into an additive (numerator, denominator) pair.

Policy losses (`POLICY_LOSSES` by name), with log r = clamp(logp - logp_old, -20, 20):
  ppo   loss = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)); for A < 0 additionally capped at
        -A c (dual clip, Ye et al. 2020). eps_high > eps_low is DAPO's clip-higher.
  gspo  the ratio is per sequence, s_i = exp(mean_t log r_t) (Zheng et al. 2025), carried to each
        token as sg[s_i] * pi_t / sg[pi_t] so gradients flow per token; log s clamped at 10.
Value loss: 0.5 max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2).

Aggregation returns a numerator and a denominator that add across micro-batches and
data-parallel ranks, so the trainer's global division (`training.forward_backward`) gives the
exact mean over the global batch whatever the micro-batching:
  token-mean               sum of token losses / number of tokens
  seq-mean-token-sum       sum over sequences of token sums / number of sequences
  seq-mean-token-mean      sum over sequences of token means / number of sequences
  seq-mean-token-sum-norm  sum of token losses / (number of sequences x max_response_length)
Sequences without response tokens do not count. (verl divides seq-mean-token-sum-norm per
micro-batch by the padded width only; the global form above is what its gradient accumulation
amounts to when responses are padded to max_response_length.)
"""

from __future__ import annotations

from typing import Callable

import torch

from mcore_rl.config.algorithm import AlgorithmConfig

from .registry import Registry

LOG_RATIO_LIMIT = 20.0

PolicyLoss = Callable[..., tuple]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def _masked_fraction(condition: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (condition.float() * mask).sum() / mask.sum().clamp(min=1)


@POLICY_LOSSES.register("ppo")
def ppo_loss(logprobs, old_logprobs, advantages, mask, config: AlgorithmConfig):
    """Per-token clipped PPO loss [b, s] and metrics (clip fractions, approximate KL)."""
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
    clipped_max = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * config.clip_ratio_c
    losses = torch.where(advantages < 0, torch.minimum(dual_bound, clipped_max), clipped_max)
    metrics = {"actor/clip_fraction": _masked_fraction(clipped > unclipped, mask),
               "actor/dual_clip_fraction": _masked_fraction((clipped_max > dual_bound)
                                                            & (advantages < 0), mask),
               "actor/approx_kl": (-log_ratio * mask).sum() / mask.sum().clamp(min=1)}
    return losses, metrics


@POLICY_LOSSES.register("gspo")
def gspo_loss(logprobs, old_logprobs, advantages, mask, config: AlgorithmConfig):
    """Per-token GSPO loss [b, s] (sequence-level ratio) and metrics."""
    log_ratio = logprobs - old_logprobs
    lengths = mask.sum(dim=-1).clamp(min=1)
    sequence_log_ratio = (log_ratio * mask).sum(dim=-1) / lengths
    token_log_ratio = logprobs - logprobs.detach() + sequence_log_ratio.detach().unsqueeze(-1)
    ratio = token_log_ratio.clamp(max=10.0).exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
    metrics = {"actor/clip_fraction": _masked_fraction(clipped > unclipped, mask),
               "actor/approx_kl": (-log_ratio * mask).sum() / mask.sum().clamp(min=1)}
    return torch.maximum(unclipped, clipped), metrics


def value_loss(values, old_values, returns, mask, config: AlgorithmConfig):
    """Per-token clipped value loss [b, s] and the fraction where clipping bound."""
    clipped_values = old_values + (values - old_values).clamp(-config.value_clip,
                                                              config.value_clip)
    unclipped_loss = (values - returns) ** 2
    clipped_loss = (clipped_values - returns) ** 2
    losses = 0.5 * torch.maximum(unclipped_loss, clipped_loss)
    return losses, {"critic/clip_fraction": _masked_fraction(clipped_loss > unclipped_loss,
                                                              mask)}


def aggregate(losses: torch.Tensor, mask: torch.Tensor, mode: str,
              max_response_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(numerator, integer-valued denominator) of `mode` over this micro-batch, both tensors on
    the losses' device (reading a count on the host would stall the schedule once per
    micro-batch); see the module doc."""
    mask = mask.to(losses.dtype)
    token_sums = (losses * mask).sum(dim=-1)
    token_counts = mask.sum(dim=-1)
    sequences = (token_counts > 0).sum()
    if mode == "token-mean":
        return token_sums.sum(), token_counts.sum()
    if mode == "seq-mean-token-sum":
        return token_sums.sum(), sequences
    if mode == "seq-mean-token-mean":
        return (token_sums / token_counts.clamp(min=1)).sum(), sequences
    if mode == "seq-mean-token-sum-norm":
        return token_sums.sum(), sequences * max_response_length
    raise ValueError(f"unknown loss aggregation {mode!r}")

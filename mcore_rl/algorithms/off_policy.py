"""Off-policy corrections from the engine's (behaviour) log-probs.

The engine samples from a distribution that differs from the one the trainer scores: kernels
and precision differ, and with asynchronous or one-step-ahead rollouts the engine's weights are
one or more updates old. The ratio between the two is known for every sampled token:

    ratio_t = exp(logp_old(x_t) - logp_engine(x_t))                      (token level)
    ratio_i = exp(sum_t (logp_old(x_t) - logp_engine(x_t)))              (sequence level, per
                                                                          response, on all its
                                                                          tokens)

Two ways of using it (verl's rollout correction, Yao et al. 2025):
    truncate   weight = min(ratio, cap)                              every token keeps training
    mask       weight = ratio, and a token (or whole response) whose ratio leaves [floor, cap]
               is dropped from the loss, numerator and denominator alike
The weights are detached: they rescale the policy-gradient estimate, they are not optimised.
"""

from __future__ import annotations

import torch

from mcore_rl.config.rl import ImportanceCorrection


def importance_ratios(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor,
                      mask: torch.Tensor, level: str) -> torch.Tensor:
    """[n, s] ratios (detached); at sequence level every token of a row carries its response's
    ratio, summed over the tokens where `mask` is 1."""
    log_ratio = (old_logprobs - engine_logprobs).detach()
    if level == "sequence":
        log_ratio = (log_ratio * mask).sum(dim=1, keepdim=True).expand_as(log_ratio)
    return log_ratio.exp()


def importance_weights(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor,
                       mask: torch.Tensor, correction: ImportanceCorrection
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, keep) [n, s]: the per-token loss weights and which tokens stay in the loss
    (all of them when truncating)."""
    ratio = importance_ratios(old_logprobs, engine_logprobs, mask, correction.level)
    if correction.mode == "truncate":
        return ratio.clamp(max=correction.cap), torch.ones_like(ratio)
    kept = (ratio >= correction.floor) & (ratio <= correction.cap)
    return torch.where(kept, ratio, 0.0), kept.to(ratio.dtype)

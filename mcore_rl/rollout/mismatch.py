"""How far the engine's log-probs are from the trainer's, as metrics logged every step.

PPO's ratio and the truncated importance-sampling correction assume that the engine sampled from
the policy the trainer scores. Kernels, precision and batch shapes differ between the two, so the
gap is measured on every batch, over response tokens only:

    delta_t   = logp_trainer(x_t) - logp_engine(x_t)
    abs diff  = mean_t |delta_t|, max_t |delta_t|
    k3 KL     = mean_t (exp(delta_t) - 1 - delta_t)     (Schulman's k3 estimator of
                KL(engine || trainer) from engine samples; >= 0 termwise)
"""

from __future__ import annotations

import torch


def logprob_mismatch(engine_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor,
                     response_mask: torch.Tensor) -> dict[str, float]:
    """Mismatch metrics over the positions where response_mask is 1 (tensors [n, s])."""
    mask = response_mask.bool()
    if not bool(mask.any()):
        raise ValueError("logprob_mismatch: response_mask selects no tokens")
    delta = (trainer_logprobs.double() - engine_logprobs.double())[mask]
    return {
        "rollout/logprob_abs_diff_mean": float(delta.abs().mean()),
        "rollout/logprob_abs_diff_max": float(delta.abs().max()),
        "rollout/k3_kl": float((delta.exp() - 1 - delta).mean()),
    }

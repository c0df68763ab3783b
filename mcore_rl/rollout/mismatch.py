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

from mcore_rl.observability.step_metrics import SumsAndCounts


def add_logprob_mismatch(stats: SumsAndCounts, engine_logprobs: torch.Tensor,
                         trainer_logprobs: torch.Tensor, response_mask: torch.Tensor) -> None:
    """Accumulate the mismatch metrics of this rank's response tokens (tensors [n, s]); the
    caller reduces them over data-parallel ranks."""
    mask = response_mask.bool()
    delta = (trainer_logprobs.double() - engine_logprobs.double())
    stats.add("rollout/logprob_abs_diff_mean", delta.abs(), mask)
    stats.add_max("rollout/logprob_abs_diff_max", delta.abs()[mask])
    stats.add("rollout/k3_kl", delta.exp() - 1 - delta, mask)


def logprob_mismatch(engine_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor,
                     response_mask: torch.Tensor) -> dict[str, float]:
    """The mismatch metrics of one batch on this rank alone."""
    if not bool(response_mask.bool().any()):
        raise ValueError("logprob_mismatch: response_mask selects no tokens")
    stats = SumsAndCounts()
    add_logprob_mismatch(stats, engine_logprobs, trainer_logprobs, response_mask)
    return stats.means()

"""The reward model's and DPO's per-micro-batch terms: Megatron's per-token outputs of a batch
of whole pairs (sequence 2i chosen, 2i + 1 rejected) -> per-pair losses and statistics.

Training sums the losses and divides by the global pair count (`train_step`'s numerator and
denominator), evaluation sums losses and statistics over every held-out pair; both read the
same terms, so the logged held-out numbers are exactly the training quantities.
"""

from __future__ import annotations

from typing import Callable

import torch

from mcore_rl.algorithms.preference import bradley_terry, dpo
from mcore_rl.config.preference import DpoConfig, RmConfig

PairTerms = Callable[[dict, dict], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""(per-token outputs, micro-batch) -> ([pairs] losses, {statistic: [pairs] values})."""

RM_STATISTICS = ("accuracy", "margin", "reward_chosen", "reward_rejected")
DPO_STATISTICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin",
                  "logps/chosen", "logps/rejected")


def reward_model_terms(outputs: dict, micro_batch: dict, config: RmConfig):
    """Bradley-Terry losses of the scores at each sequence's last token (the batch went
    through `with_score_slot`; its "score_position" says where the score is)."""
    positions = micro_batch["score_position"]
    values = outputs["values"]
    scores = values[torch.arange(len(positions), device=values.device),
                    positions.to(values.device)]
    chosen, rejected = scores[0::2], scores[1::2]
    losses = bradley_terry(chosen, rejected, config.margin, config.reward_l2)
    return losses, {"accuracy": (chosen > rejected).float(), "margin": chosen - rejected,
                    "reward_chosen": chosen, "reward_rejected": rejected}


def sequence_logprobs(logprobs: torch.Tensor, loss_mask: torch.Tensor,
                      mean: bool) -> torch.Tensor:
    """[n] sum (mean: per-token mean) of each sequence's response log-probs."""
    mask = loss_mask.to(logprobs.device, torch.float32)
    total = (logprobs * mask).sum(dim=1)
    return total / mask.sum(dim=1).clamp(min=1) if mean else total


def dpo_terms(outputs: dict, micro_batch: dict, config: DpoConfig):
    """DPO (or IPO) losses from the policy's and the reference's response log-probs (the batch
    carries the reference's as "ref_logprobs"); rewards are beta x the log-ratios."""
    mean = config.loss_type == "ipo"
    policy = sequence_logprobs(outputs["logprobs"], micro_batch["loss_mask"], mean)
    reference = sequence_logprobs(micro_batch["ref_logprobs"].to(policy.device),
                                  micro_batch["loss_mask"], mean)
    chosen_ratio = policy[0::2] - reference[0::2]
    rejected_ratio = policy[1::2] - reference[1::2]
    losses = dpo(chosen_ratio, rejected_ratio, config.beta, config.loss_type,
                 config.label_smoothing)
    chosen, rejected = config.beta * chosen_ratio.detach(), config.beta * rejected_ratio.detach()
    return losses, {"rewards/chosen": chosen, "rewards/rejected": rejected,
                    "rewards/accuracy": (chosen > rejected).float(),
                    "rewards/margin": chosen - rejected, "logps/chosen": policy[0::2],
                    "logps/rejected": policy[1::2]}


def pair_objective(terms: PairTerms, section: str):
    """`train_step`'s loss function: summed pair losses over the pair count, and the mean of
    each statistic (equal micro-batches: the mean of micro-batch means is the batch mean)."""
    def objective(outputs: dict, micro_batch: dict):
        losses, statistics = terms(outputs, micro_batch)
        return losses.sum(), len(losses), {f"{section}/{name}": value.detach().float().mean()
                                           for name, value in statistics.items()}
    return objective


def pair_sums(terms: PairTerms, outputs: dict, micro_batch: dict,
              names: tuple[str, ...]) -> torch.Tensor:
    """[loss sum, pair count, statistic sums in `names` order] of one held-out micro-batch."""
    losses, statistics = terms(outputs, micro_batch)
    return torch.stack([losses.sum().double(), torch.tensor(float(len(losses)),
                                                            dtype=torch.float64,
                                                            device=losses.device)]
                       + [statistics[name].double().sum() for name in names])

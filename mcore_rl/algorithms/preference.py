"""Pairwise preference losses as pure tensor functions: one loss per (chosen, rejected) pair.

  bradley_terry  -log sigmoid(r_c - r_r - margin) + l2 (r_c^2 + r_r^2)      (reward models;
                 margin as in Llama 2's reward model, l2 keeps scores near 0)
  dpo sigmoid    -(1 - s) log sigmoid(beta h) - s log sigmoid(-beta h)     (DPO; s > 0: cDPO)
  dpo ipo        (h - 1 / (2 beta))^2                                       (IPO)
with h = (log pi(c) - log ref(c)) - (log pi(r) - log ref(r)), the policy's log-ratio margin.

The per-pair losses are summed by the caller and divided by the global number of pairs, so the
loss is the exact mean over the step's pairs whatever the micro-batching and DP layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bradley_terry(chosen: torch.Tensor, rejected: torch.Tensor, margin: float = 0.0,
                  l2: float = 0.0) -> torch.Tensor:
    """[pairs] losses of reward-model scores `chosen`, `rejected` [pairs]."""
    loss = -F.logsigmoid(chosen - rejected - margin)
    if l2:
        loss = loss + l2 * (chosen.square() + rejected.square())
    return loss


def dpo(chosen_logratio: torch.Tensor, rejected_logratio: torch.Tensor, beta: float,
        loss_type: str = "sigmoid", label_smoothing: float = 0.0) -> torch.Tensor:
    """[pairs] losses from the policy-minus-reference log-probabilities of the chosen and the
    rejected responses (for ipo: per-token means, as in the IPO paper)."""
    margin = chosen_logratio - rejected_logratio
    if loss_type == "sigmoid":
        return (-(1 - label_smoothing) * F.logsigmoid(beta * margin)
                - label_smoothing * F.logsigmoid(-beta * margin))
    if loss_type == "ipo":
        return (margin - 1 / (2 * beta)).square()
    raise ValueError(f"loss_type={loss_type!r} must be sigmoid or ipo")

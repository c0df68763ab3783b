"""The reward model: a frozen scalar-head Megatron model scoring prompt + response sequences,
the alternative to rule rewards. The score is the head's output at the sequence's last token,
as transformers' `...ForSequenceClassification` reads it."""

from __future__ import annotations

import torch

from mcore_rl.training import compute_outputs


class RewardModel:
    """Frozen scalar-head model; every rank of the world calls `score` together."""

    def __init__(self, module: torch.nn.Module, micro_batch_size: int):
        for param in module.parameters():
            param.requires_grad_(False)
        self.module = module
        self.micro_batch_size = micro_batch_size

    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[n] scores of right-padded rows. Per-token outputs are aligned to the token after
        the one that produced them, so one extra position is opened per row: its output slot
        holds the head's value at the last real token (causal attention keeps the extra token
        from changing anything before it)."""
        lengths = attention_mask.sum(dim=1)
        rows = torch.arange(len(lengths))
        extended_ids = torch.nn.functional.pad(input_ids, (0, 1))
        extended_mask = torch.nn.functional.pad(attention_mask, (0, 1))
        extended_mask[rows, lengths] = 1
        values = compute_outputs([self.module], {"input_ids": extended_ids,
                                                 "attention_mask": extended_mask},
                                 self.micro_batch_size, "scalar")["values"]
        return values[rows, lengths]

"""The reward model: a frozen scalar-head Megatron model scoring prompt + response sequences,
the alternative to rule rewards. The score is the head's output at the sequence's last token,
as transformers' `...ForSequenceClassification` reads it."""

from __future__ import annotations

import torch

from mcore_rl.training import compute_outputs
from mcore_rl.training.batches import pad_rows_to_multiple, with_score_slot


class RewardModel:
    """Frozen scalar-head model; every rank of the world calls `score` together."""

    def __init__(self, module: torch.nn.Module, micro_batch_size: int):
        for param in module.parameters():
            param.requires_grad_(False)
        self.module = module
        self.micro_batch_size = micro_batch_size

    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[n] scores of right-padded rows, any n (an evaluation's count need not divide into
        micro-batches): the head's output at each row's last token."""
        batch, last = with_score_slot({"input_ids": input_ids, "attention_mask": attention_mask})
        padded = pad_rows_to_multiple(batch, self.micro_batch_size)
        values = compute_outputs([self.module], padded, self.micro_batch_size, "scalar")["values"]
        return values[torch.arange(len(last), device=values.device), last.to(values.device)]

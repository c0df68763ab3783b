"""A scalar head in place of the LM head: per-token values (critic) or a sequence score (reward
model, read at the last valid token).

It replaces GPTModel.output_layer and keeps its call signature, so Megatron's GPTModel forward,
pipeline schedules and checkpointing need no changes. The weight is tiny and replicated on every
TP rank. Without sequence parallelism the hidden states entering it are replicated too, so every
TP rank computes the same values and receives the same gradient. With it, each TP rank scores
its chunk of the sequence and the values are gathered: the weight's gradient is then a partial
sum, which Megatron sums over the TP ranks (the weight is marked `sequence_parallel`, as norms
are). Gathering the hidden states first instead gave every rank the whole gradient, and that sum
doubled it at TP2 (tests/test_layout_invariance.py).
"""

from __future__ import annotations

import torch
from torch import nn


class ScalarHead(nn.Module):
    """hidden [s, b, h] -> scalar [s, b, 1], called like Megatron's output layer."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, sequence_parallel: bool = False,
                 device: torch.device | None = None):
        super().__init__()
        # Named apart from the LM head's `weight` so checkpoints of the two never mix.
        self.scalar_weight = nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device))
        self.sequence_parallel = sequence_parallel
        # Megatron's optimizer and DDP read these attributes on every parameter.
        self.scalar_weight.tensor_model_parallel = False
        self.scalar_weight.sequence_parallel = sequence_parallel

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        values = hidden_states @ self.scalar_weight.t()
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
            values = gather_from_sequence_parallel_region(values,
                                                          tensor_parallel_output_grad=False)
        return values, None

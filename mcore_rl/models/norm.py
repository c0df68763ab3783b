"""RMSNorm for Megatron's local (torch) layer spec, with sequence parallelism.

Megatron-Core's local spec normalises with `WrappedTorchNorm`, which refuses sequence
parallelism outright; only Transformer Engine's and Apex's norms take it. So without TE (every
CPU, GPU machines without it) no model trained with sequence parallelism, and Megatron's MoE
layer needs it at TP > 1. Under sequence parallelism a norm sees only its TP rank's chunk of
the sequence, so its weight's gradient is a partial sum: Megatron's `finalize_model_grads`
all-reduces it over the TP group when the weight says `sequence_parallel` (as TE's and Apex's
norms mark theirs). That mark is all this module adds; the numbers are torch's RMSNorm's.
"""

from __future__ import annotations

import dataclasses

import torch


class RMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm built from a TransformerConfig, its weight marked for Megatron's
    sequence-parallel gradient reduction (see the module doc)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel


def with_local_norms(layer_spec) -> None:
    """Every `WrappedTorchNorm` of a layer spec (its input, pre-MLP, query and key norms)
    becomes `RMSNorm`, in place; other norms (Apex's) and identities stay."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    for submodules in (layer_spec.submodules, layer_spec.submodules.self_attention.submodules):
        for field in dataclasses.fields(submodules):
            if getattr(submodules, field.name) is WrappedTorchNorm:
                setattr(submodules, field.name, RMSNorm)

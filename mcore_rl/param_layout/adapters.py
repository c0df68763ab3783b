"""Adapters (LoRA): which linears an adapter may sit on and how its two matrices are split.

Why this module exists
----------------------
An adapter's matrices are parameters of their linear layer, sharded like it (DESIGN.md,
"Adapters"): A [r, in] and B [out, r] follow the linear's tensor-parallel split on one side and
are whole on the other. Models, checkpoints, the PEFT export and the resharder ask these rules
rather than guessing; they change when adapters may sit on new linears.
"""

from __future__ import annotations

import re
from typing import Sequence

import torch

from mcore_rl.config.model import ModelConfig
from mcore_rl.param_layout.rules import ShardKind, shard_kind
from mcore_rl.param_layout.tensor_parallel import _check_rank, _merge, _split


ADAPTER_MATRICES = ("lora_a", "lora_b")
"""The two matrices of an adapter, as parameters of their linear: ``<linear>.lora_a`` [r, in]
and ``<linear>.lora_b`` [out, r]."""

_ADAPTER = re.compile(r"^(decoder\.layers\.\d+\.(?:self_attention|mlp|mlp\.shared_experts)"
                      r"\.linear_\w+)\.(lora_a|lora_b)$")


def adapter_of(name: str) -> tuple[str, str] | None:
    """(the adapted linear's weight name, "lora_a" or "lora_b") for an adapter parameter's
    name; None for any other name."""
    match = _ADAPTER.match(name)
    if not match:
        return None
    return f"{match.group(1)}.weight", match.group(2)


def adapted_weights(model: ModelConfig, layer: int, targets: Sequence[str]) -> list[str]:
    """The weights of global layer `layer` that adapters on the Megatron linears `targets`
    adapt: attention's, and the MLP's in a dense layer or the shared expert's in a
    Mixture-of-Experts layer (routed experts take none; models/lora.py)."""
    names = []
    for target in targets:
        if target in ("linear_qkv", "linear_proj"):
            names.append(f"decoder.layers.{layer}.self_attention.{target}.weight")
        elif not model.moe.is_moe_layer(layer):
            names.append(f"decoder.layers.{layer}.mlp.{target}.weight")
        elif model.moe.shared_expert_ffn_hidden_size:
            names.append(f"decoder.layers.{layer}.mlp.shared_experts.{target}.weight")
    return names


def adapter_kind(name: str) -> ShardKind:
    """How adapter parameter ``name`` is split across TP ranks, following its linear: a
    row-parallel linear's A is split on its input columns (B whole); any other linear's B is
    split on its output rows like the linear's weight (A whole)."""
    base, matrix = adapter_of(name)
    kind = shard_kind(base)
    if kind is ShardKind.ROW:
        return ShardKind.ROW if matrix == "lora_a" else ShardKind.REPLICATED
    return ShardKind.REPLICATED if matrix == "lora_a" else kind


def split_adapter(name: str, full: torch.Tensor, tp_size: int, tp_rank: int) -> torch.Tensor:
    """Rank ``tp_rank``'s shard of adapter parameter ``name``'s full tensor."""
    _check_rank(tp_rank, tp_size, "tp_rank")
    return _split(adapter_kind(name), full, tp_size, tp_rank)


def merge_adapter(name: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Adapter parameter ``name``'s full tensor from its shards in TP rank order."""
    return _merge(adapter_kind(name), shards).contiguous()

"""vLLM's tensor-parallel layout: which canonical rows each vLLM parameter holds, and its names.

Why this module exists
----------------------
The ``vllm`` rollout layout (layouts.py) delivers each rank its shards in vLLM's own layout, so
that the engine copies them in place. That layout differs from Megatron's in three places, all
written here: QKVParallelLinear holds, per rank, its query heads, then its KV heads, then the
same KV heads' values (KV heads replicated when TP > KV heads); VocabParallelEmbedding and
ParallelLMHead pad the vocabulary to a multiple of 64 and split it evenly, padding rows zero;
and the parameters carry vLLM's names. MergedColumnParallelLinear holds [gate chunk; up chunk]
(as Megatron's fc1), o_proj and down_proj are row-parallel, norms replicated.
Mixture-of-Experts layers (no vLLM expert parallelism): the router is ``{block}.gate``
(replicated), and expert e's rows are slot e of the layer's fused ``w13_weight`` ([gate chunk;
up chunk], like the dense MLP) and ``w2_weight`` (row-parallel), named
``...routed_experts.w13_weight[e]`` here; the engine adapter assembles the slots.
"""

from __future__ import annotations

import re

from mcore_rl.config.model import ModelConfig
from mcore_rl.param_layout import sharding
from mcore_rl.param_layout.sharding import ShardKind

from .shards import Interval, chunk, megatron_pieces, merge_adjacent, vocab_pieces

VLLM_VOCAB_PADDING = 64
"""vLLM pads the vocabulary of VocabParallelEmbedding/ParallelLMHead to a multiple of this
(``DEFAULT_VOCAB_PADDING_SIZE``) before splitting it over TP ranks."""


def vllm_vocab_size(model: ModelConfig) -> int:
    """Rows of vLLM's embedding and LM head: the vocabulary padded to a multiple of 64."""
    return -(-model.vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING


def _vllm_qkv_pieces(model: ModelConfig, tp: int, tp_rank: int) -> tuple[Interval, ...]:
    """Rows of vLLM's QKVParallelLinear on ``tp_rank`` ([its q heads; its k heads; its v heads])
    as intervals of Megatron's per-group fused layout."""
    head_dim, q_per_group = model.kv_channels, model.heads_per_kv_group
    group_rows = (q_per_group + 2) * head_dim
    q_heads = range(*chunk(model.num_attention_heads, tp, tp_rank))
    if tp >= model.kv_heads:
        kv_heads = [tp_rank // (tp // model.kv_heads)]
    else:
        kv_heads = range(*chunk(model.kv_heads, tp, tp_rank))

    def rows(group: int, head_in_group: int) -> Interval:
        start = group * group_rows + head_in_group * head_dim
        return start, start + head_dim

    q = [rows(head // q_per_group, head % q_per_group) for head in q_heads]
    k = [rows(group, q_per_group) for group in kv_heads]
    v = [rows(group, q_per_group + 1) for group in kv_heads]
    return merge_adjacent(q) + merge_adjacent(k) + merge_adjacent(v)


def vllm_pieces(name: str, model: ModelConfig, tp: int,
                tp_rank: int) -> tuple[tuple[Interval, ...], int]:
    """(pieces, padding) of vLLM TP rank ``tp_rank`` for canonical parameter ``name``."""
    kind = sharding.shard_kind(name)
    if kind is ShardKind.QKV:
        return _vllm_qkv_pieces(model, tp, tp_rank), 0
    if kind is ShardKind.VOCAB:
        return vocab_pieces(model.vocab_size, vllm_vocab_size(model), tp, tp_rank)
    return megatron_pieces(name, model, tp, tp_rank)


# --------------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------------

_VLLM_LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.weight": "self_attn.qkv_proj.weight",
    "self_attention.linear_qkv.bias": "self_attn.qkv_proj.bias",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.weight": "mlp.gate_up_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
"""Canonical per-layer suffix -> vLLM Llama-family parameter suffix."""

_VLLM_MOE_NAMES = {
    "mlp.router.weight": "{block}.gate.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
    "mlp.shared_experts.linear_fc1.weight": "mlp.shared_expert.gate_up_proj.weight",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_expert.down_proj.weight",
}
"""Canonical MoE suffix -> vLLM suffix; ``{block}`` is the MoE module (mlp, Mixtral's
block_sparse_moe)."""

_VLLM_EXPERT = {"linear_fc1": "w13_weight", "linear_fc2": "w2_weight"}
"""Expert linear -> vLLM's fused parameter holding every expert of a layer."""

_VLLM_GLOBAL_NAMES = {
    sharding.EMBEDDING: "model.embed_tokens.weight",
    sharding.FINAL_NORM: "model.norm.weight",
    sharding.OUTPUT_LAYER: "lm_head.weight",
}
"""Canonical non-layer name -> vLLM Llama-family parameter name."""

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
VLLM_EXPERT_SLOT = re.compile(r"^(.+)\[(\d+)\]$")
"""An expert's slot in a fused vLLM parameter: ``<parameter name>[<expert>]``."""


def vllm_name(canonical: str, moe_block: str = "mlp") -> str:
    """vLLM's name for canonical parameter ``canonical`` in the Llama family (Llama, Qwen2,
    Qwen3, Mistral) and its MoE members (Qwen3-MoE, Qwen2-MoE; Mixtral with ``moe_block``
    block_sparse_moe). An expert's tensor is a slot of its layer's fused parameter."""
    match = _LAYER.match(canonical)
    if not match:
        return _VLLM_GLOBAL_NAMES[canonical]
    layer, suffix = match.groups()
    expert = _EXPERT.match(suffix)
    if expert:
        index, linear = expert.groups()
        return (f"model.layers.{layer}.{moe_block}.experts.routed_experts."
                f"{_VLLM_EXPERT[linear]}[{index}]")
    if suffix in _VLLM_MOE_NAMES:
        return f"model.layers.{layer}.{_VLLM_MOE_NAMES[suffix].format(block=moe_block)}"
    return f"model.layers.{layer}.{_VLLM_LAYER_NAMES[suffix]}"


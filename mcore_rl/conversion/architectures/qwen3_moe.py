"""Qwen3MoeForCausalLM (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (QK-norm) with
routed SwiGLU experts in place of the MLP.

The router is a softmax over all experts then the top `num_experts_per_tok`, renormalised when
`norm_topk_prob` (the released models set it; transformers' default is false). Layers in
`mlp_only_layers` or off the `decoder_sparse_step` grid keep a dense MLP of
`intermediate_size`; experts are `moe_intermediate_size` wide. transformers 5 writes the expert
count as `num_local_experts`, the Hub's files as `num_experts`; both are read (the default sits
under the first, so that a file's `num_experts` wins over it).
"""

from __future__ import annotations

from .hf_tensors import HfMoeLayout
from .llama_family import Architecture
from .qwen3 import QWEN3_REFUSALS

QWEN3_MOE_DEFAULTS = {
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_hidden_layers": 24, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": None, "hidden_act": "silu",
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "attention_bias": False, "use_sliding_window": False, "num_local_experts": 128,
    "num_experts_per_tok": 8, "norm_topk_prob": False, "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
"""transformers' Qwen3MoeConfig defaults for the keys that decide the math."""

QWEN3_MOE = Architecture(
    name="Qwen3MoeForCausalLM",
    model_type="qwen3_moe",
    defaults=QWEN3_MOE_DEFAULTS,
    refusals=QWEN3_REFUSALS,
    export_fields={"attention_bias": False, "use_sliding_window": False},
    qk_norm=True,
    moe=HfMoeLayout(),
)
"""The Qwen3-MoE architecture."""

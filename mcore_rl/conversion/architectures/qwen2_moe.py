"""Qwen2MoeForCausalLM (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v bias) with
routed SwiGLU experts and an always-on shared expert, whose output is scaled per token by
sigmoid(shared_expert_gate(x)).

Routing as in Qwen3-MoE (`norm_topk_prob` defaults to false here, as in the released models).
"""

from __future__ import annotations

from .hf_tensors import HfMoeLayout
from .llama_family import Architecture
from .qwen2 import NO_SLIDING_WINDOW
from .refusals import COMMON_REFUSALS, must_be

QWEN2_MOE_DEFAULTS = {
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
    "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
    "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
    "head_dim": None, "hidden_act": "silu", "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "qkv_bias": True,
    "use_sliding_window": False, "num_experts": 60, "num_experts_per_tok": 4,
    "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
}
"""transformers' Qwen2MoeConfig defaults for the keys that decide the math."""

QWEN2_MOE = Architecture(
    name="Qwen2MoeForCausalLM",
    model_type="qwen2_moe",
    defaults=QWEN2_MOE_DEFAULTS,
    refusals=COMMON_REFUSALS + (
        must_be("qkv_bias", True, "the Megatron model of this architecture has q/k/v biases"),
        NO_SLIDING_WINDOW,
    ),
    export_fields={"qkv_bias": True, "use_sliding_window": False},
    uses_layer_types=True,
    qkv_bias=True,
    moe=HfMoeLayout(num_experts_keys=("num_experts",), shared_expert=True),
)
"""The Qwen2-MoE architecture."""

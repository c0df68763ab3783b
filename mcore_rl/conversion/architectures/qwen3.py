"""Qwen3ForCausalLM (dense Qwen3): Llama plus a per-head RMSNorm on queries and keys (QK-norm).

Unlike Qwen2 there is no q/k/v bias; `attention_bias` would add one to o_proj too, which the
Megatron model lacks, so it is refused. transformers defaults head_dim to 128 here (not
hidden/heads), so that default matters for configs that omit it. Qwen3-MoE is a different
architecture (Qwen3MoeForCausalLM, qwen3_moe.py).
"""

from __future__ import annotations

from .llama_family import Architecture
from .refusals import COMMON_REFUSALS, must_be

QWEN3_DEFAULTS = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
    "use_sliding_window": False,
}
"""transformers' Qwen3Config defaults for the keys that decide the math."""

QWEN3_REFUSALS = COMMON_REFUSALS + (
    must_be("attention_bias", False,
            "it adds a bias to o_proj as well, which the Megatron model does not have"),
    must_be("use_sliding_window", False, "sliding-window attention is not implemented"),
)
"""What Qwen3 and Qwen3-MoE refuse."""

QWEN3 = Architecture(
    name="Qwen3ForCausalLM",
    model_type="qwen3",
    defaults=QWEN3_DEFAULTS,
    refusals=QWEN3_REFUSALS,
    export_fields={"attention_bias": False, "use_sliding_window": False},
    uses_layer_types=True,
    qk_norm=True,
)
"""The Qwen3 architecture."""

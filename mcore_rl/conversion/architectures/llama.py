"""LlamaForCausalLM: Llama 2, Llama 3.x (with "llama3" RoPE scaling) and SmolLM2.

Plain Llama has no biases anywhere, so the `attention_bias` and `mlp_bias` switches are refused:
`attention_bias` also biases o_proj, which the Megatron model has no parameter for, and
`mlp_bias` biases the SwiGLU projections.
"""

from __future__ import annotations

from .llama_family import Architecture
from .refusals import COMMON_REFUSALS, must_be

LLAMA_DEFAULTS = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
    "head_dim": None, "hidden_act": "silu", "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
    "mlp_bias": False, "pretraining_tp": 1,
}
"""transformers' LlamaConfig defaults for the keys that decide the math."""

LLAMA = Architecture(
    name="LlamaForCausalLM",
    model_type="llama",
    defaults=LLAMA_DEFAULTS,
    refusals=COMMON_REFUSALS + (
        must_be("attention_bias", False,
                "it adds a bias to o_proj as well, which the Megatron model does not have"),
        must_be("mlp_bias", False, "the Megatron MLP has no biases"),
    ),
    export_fields={"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1},
)
"""The Llama architecture."""

"""MixtralForCausalLM (Mixtral 8x7B, 8x22B): Mistral's attention with 8 routed SwiGLU experts in
every layer, under `block_sparse_moe` with projections w1 (gate), w3 (up), w2 (down).

The router always renormalises its top-k probabilities (transformers keeps them in fp32; a
bf16 Megatron model rounds them to bf16). `intermediate_size` is the experts' width; there are
no dense layers. `router_jitter_noise` only perturbs transformers' own training and is ignored.
A sliding window shorter than the context is refused as for Mistral.
"""

from __future__ import annotations

from .hf_tensors import HfMoeLayout
from .llama_family import Architecture
from .mistral import SHORT_WINDOW_REFUSAL
from .refusals import COMMON_REFUSALS

MIXTRAL_DEFAULTS = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": None, "hidden_act": "silu", "max_position_embeddings": 4096 * 32,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "sliding_window": None,
    "num_local_experts": 8, "num_experts_per_tok": 2, "rope_theta": 1e6,
}
"""transformers' MixtralConfig defaults for the keys that decide the math."""

MIXTRAL = Architecture(
    name="MixtralForCausalLM",
    model_type="mixtral",
    defaults=MIXTRAL_DEFAULTS,
    refusals=COMMON_REFUSALS + (SHORT_WINDOW_REFUSAL,),
    export_fields={"sliding_window": None},
    moe=HfMoeLayout(block="block_sparse_moe", projections=("w1", "w3", "w2"),
                    num_experts_keys=("num_local_experts",), expert_ffn_key="intermediate_size",
                    normalize_key=None, sparse_step_keys=False),
)
"""The Mixtral architecture."""

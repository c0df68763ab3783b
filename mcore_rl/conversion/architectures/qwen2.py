"""Qwen2ForCausalLM (Qwen2, Qwen2.5): Llama plus a bias on the q/k/v projections.

Qwen2 configs carry `sliding_window` (often equal to the context) next to
`use_sliding_window: false`; transformers ignores the window unless `use_sliding_window` is
true, so only that switch is refused.
"""

from __future__ import annotations

from .llama_family import Architecture
from .refusals import COMMON_REFUSALS, must_be

QWEN2_DEFAULTS = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    "head_dim": None, "hidden_act": "silu", "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "use_sliding_window": False,
}
"""transformers' Qwen2Config defaults for the keys that decide the math."""

NO_SLIDING_WINDOW = must_be("use_sliding_window", False,
                            "sliding-window attention is not implemented")
"""Qwen2's and Qwen2-MoE's switch for their (per-layer) sliding window."""

QWEN2 = Architecture(
    name="Qwen2ForCausalLM",
    model_type="qwen2",
    defaults=QWEN2_DEFAULTS,
    refusals=COMMON_REFUSALS + (NO_SLIDING_WINDOW,),
    export_fields={"use_sliding_window": False},
    uses_layer_types=True,
    qkv_bias=True,
)
"""The Qwen2 architecture."""

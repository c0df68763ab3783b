"""MistralForCausalLM: Llama with grouped-query attention and, in v0.1, a sliding window.

A window shorter than the context changes which tokens attend to which, and is not implemented,
so it is refused; Mistral 7B v0.2/v0.3 and later set `sliding_window: null` and convert. Note
that transformers' default window is 4096, so a config that omits the key is refused too (as
transformers would apply the window).
"""

from __future__ import annotations

from typing import Any, Mapping

from .llama_family import Architecture
from .refusals import COMMON_REFUSALS, Refusal

MISTRAL_DEFAULTS = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": None, "hidden_act": "silu", "max_position_embeddings": 4096 * 32,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "sliding_window": 4096,
}
"""transformers' MistralConfig defaults for the keys that decide the math."""


def window_covers_context(window: Any, resolved: Mapping[str, Any]) -> bool:
    """True when there is no window or it is at least the whole context (so never applies)."""
    return window is None or window >= resolved["max_position_embeddings"]


SHORT_WINDOW_REFUSAL = Refusal(
    "sliding_window", window_covers_context,
    "a window shorter than max_position_embeddings is sliding-window attention, which is not "
    "implemented")
"""Mistral's and Mixtral's sliding window, refused unless it covers the whole context."""

MISTRAL = Architecture(
    name="MistralForCausalLM",
    model_type="mistral",
    defaults=MISTRAL_DEFAULTS,
    refusals=COMMON_REFUSALS + (SHORT_WINDOW_REFUSAL,),
    export_fields={"sliding_window": None},
)
"""The Mistral architecture."""

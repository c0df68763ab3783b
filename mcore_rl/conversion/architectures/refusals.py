"""Refusals: config.json fields that would change the math and are not supported.

Why this module exists
----------------------
A checkpoint converted "successfully" with a field we cannot reproduce would be a model that is
silently different from the original, so every such field is refused loudly, naming the field
and its value. The rule type, its helpers and the refusals shared by the whole Llama family live
here; each architecture file adds its own (llama_family.py's docstring says why the split).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional


@dataclass(frozen=True)
class Refusal:
    """One config field whose value must pass `accepts`, else the conversion is refused."""

    field: str
    """config.json key."""

    accepts: Callable[[Any, Mapping[str, Any]], bool]
    """(value, whole resolved config) -> True when the value is supported."""

    why: str
    """What the value would change, for the error message."""

    def error(self, resolved: Mapping[str, Any]) -> Optional[str]:
        """The refusal message for this config, or None when the value is supported. A missing
        key counts as None (the architecture's defaults have already been applied)."""
        value = resolved.get(self.field)
        if self.accepts(value, resolved):
            return None
        return f"{self.field}={value!r} is not supported: {self.why}"


def must_be(field_name: str, supported: Any, why: str) -> Refusal:
    """Refuse any value but `supported` (a missing key or None counts as supported when
    `supported` is falsy, as transformers treats them)."""
    def accepts(value: Any, _resolved: Mapping[str, Any]) -> bool:
        return value == supported or (not supported and value is None)
    return Refusal(field_name, accepts, why)


def must_be_none(field_name: str, why: str) -> Refusal:
    """Refuse any value but None / a missing key."""
    return Refusal(field_name, lambda value, _resolved: value is None, why)


def _all_full_attention(value: Any, _resolved: Mapping[str, Any]) -> bool:
    """True when `layer_types` is absent or lists only full-attention layers."""
    return value is None or all(kind == "full_attention" for kind in value)


def _at_most_one(value: Any, _resolved: Mapping[str, Any]) -> bool:
    """True for None, 0 or 1 (pretraining_tp > 1 splits the projections differently)."""
    return value is None or value <= 1


COMMON_REFUSALS = (
    must_be("hidden_act", "silu", "the Megatron model uses SwiGLU (SiLU-gated) MLPs only"),
    Refusal("layer_types", _all_full_attention,
            "only full attention is supported (sliding-window layers would attend differently)"),
    must_be_none("attn_logit_softcapping", "attention logit soft-capping is not implemented"),
    must_be_none("final_logit_softcapping", "final logit soft-capping is not implemented"),
    Refusal("pretraining_tp", _at_most_one,
            "transformers computes the projections in slices that round differently"),
)
"""Refusals that hold for every Llama-family architecture."""

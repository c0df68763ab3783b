"""RoPE fields of config.json: read from any spelling transformers accepts, written in both.

Why this module exists
----------------------
transformers has spelled RoPE three ways over its versions (top-level ``rope_theta``, v5
``rope_parameters``, legacy ``rope_scaling``, possibly nested by layer type), and only the
default and Llama-3 variants are implemented here. Reading and writing those spellings is one
concern that changes with transformers, apart from the rest of the config translation.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from mcore_rl.config.model import ModelConfig, RopeScalingConfig

DEFAULT_ROPE_THETA = 10000.0
"""transformers' RoPE base when a config names none (the same for all four architectures)."""

_LLAMA3_FACTORS = ("factor", "low_freq_factor", "high_freq_factor")


def _rope_dict(resolved: Mapping[str, Any]) -> tuple[str, dict]:
    """(field name, RoPE dict) as transformers 5 picks it: legacy ``rope_scaling`` wins over
    ``rope_parameters``; a dict nested under "full_attention" is unwrapped."""
    source = "rope_scaling" if resolved.get("rope_scaling") else "rope_parameters"
    params = dict(resolved.get(source) or {})
    nested = set(params) & {"full_attention", "sliding_attention"}
    if nested == {"full_attention"} and len(params) == 1:
        return f"{source}.full_attention", dict(params["full_attention"])
    if nested:
        raise ValueError(f"{source} nested by layer type {sorted(params)} is not supported: "
                         "only one RoPE for all (full-attention) layers is")
    return source, params


def read_rope(resolved: Mapping[str, Any]) -> tuple[float, Optional[RopeScalingConfig]]:
    """(rope theta, Llama-3 scaling or None) from a config in any of the spellings transformers
    accepts: top-level ``rope_theta``, v5 ``rope_parameters`` or legacy ``rope_scaling``.
    ValueError for RoPE variants we do not implement (linear, dynamic, yarn, longrope, ...)."""
    source, params = _rope_dict(resolved)
    theta = params.get("rope_theta") or resolved.get("rope_theta") or DEFAULT_ROPE_THETA
    partial = params.get("partial_rotary_factor", resolved.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor={partial!r} is not supported: RoPE is applied "
                         "to the whole head")
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise ValueError(f"{source}.rope_type={rope_type!r} is not supported: only 'default' and "
                         "'llama3' RoPE are implemented")
    missing = [key for key in _LLAMA3_FACTORS if params.get(key) is None]
    if missing:
        raise ValueError(f"{source} with rope_type 'llama3' lacks {missing}")
    original = (params.get("original_max_position_embeddings")
                or resolved["max_position_embeddings"])
    scaling = RopeScalingConfig(factor=float(params["factor"]),
                                low_freq_factor=float(params["low_freq_factor"]),
                                high_freq_factor=float(params["high_freq_factor"]),
                                original_max_position_embeddings=int(original))
    return float(theta), scaling


def write_rope(model: ModelConfig) -> dict[str, Any]:
    """config.json RoPE fields for `model`, in the v5 and the legacy spelling alike."""
    scaling = model.rope_scaling
    legacy = None
    if scaling is not None:
        legacy = {"rope_type": "llama3", "factor": scaling.factor,
                  "low_freq_factor": scaling.low_freq_factor,
                  "high_freq_factor": scaling.high_freq_factor,
                  "original_max_position_embeddings": scaling.original_max_position_embeddings}
    parameters = {"rope_type": "default", **(legacy or {}), "rope_theta": model.rope_theta}
    return {"rope_parameters": parameters, "rope_theta": model.rope_theta,
            "rope_scaling": legacy}

"""The HF architectures we convert, by the class name config.json lists in `architectures`.

Every supported architecture is a Llama-family decoder (llama_family.py holds the mapping, with
its parts in refusals.py, hf_tensors.py and rope.py), dense or with Mixture-of-Experts MLPs; the
per-architecture modules state only defaults, switches, MoE layout and refusals.
"""

from __future__ import annotations

from typing import Any, Mapping

from .llama import LLAMA
from .llama_family import Architecture
from .mistral import MISTRAL
from .mixtral import MIXTRAL
from .qwen2 import QWEN2
from .qwen2_moe import QWEN2_MOE
from .qwen3 import QWEN3
from .qwen3_moe import QWEN3_MOE

ARCHITECTURES: dict[str, Architecture] = {
    arch.name: arch for arch in (LLAMA, QWEN2, QWEN3, MISTRAL, QWEN3_MOE, QWEN2_MOE, MIXTRAL)}
"""Supported architectures by HF class name."""


def architecture_for(hf_config: Mapping[str, Any]) -> Architecture:
    """The architecture named by config.json ``architectures[0]``; ValueError listing the
    supported names when it is missing or not supported."""
    names = hf_config.get("architectures") or [None]
    supported = ", ".join(sorted(ARCHITECTURES))
    if names[0] not in ARCHITECTURES:
        raise ValueError(f"config.json architectures={hf_config.get('architectures')!r} is not "
                         f"supported; supported: {supported}")
    return ARCHITECTURES[names[0]]


__all__ = ["ARCHITECTURES", "Architecture", "architecture_for"]

"""Optional fused kernels: used where they import, their absence said once.

pip's megatron-core ships no compiled kernels. Megatron's fused masked softmax
(`scaled_masked_softmax_cuda`, built by NGC containers and Megatron-LM source installs) and
Transformer Engine's fused RoPE are switched on only when they import; asking Megatron for a
fusion whose kernel is missing fails at the first forward pass on a GPU. Without Transformer
Engine attention runs through PyTorch's fused SDPA (models/attention.py); the softmax kernels
matter only for the cases it leaves to Megatron.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from .layer_spec import transformer_engine_available

SOFTMAX_KERNELS = ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda",
                   "scaled_softmax_cuda")


@functools.cache
def fused_softmax_available() -> bool:
    """Megatron's fused scale-mask-softmax CUDA extensions import."""
    return torch.cuda.is_available() and all(
        importlib.util.find_spec(name) is not None for name in SOFTMAX_KERNELS)


@functools.cache
def fused_rope_available() -> bool:
    """Transformer Engine's fused rotary embedding, as Megatron imports it, is there."""
    if not (torch.cuda.is_available() and transformer_engine_available()):
        return False
    from megatron.core.models.common.embeddings import rope_utils

    return rope_utils.fused_apply_rotary_pos_emb is not None


@functools.cache
def announce_missing_kernels() -> None:
    """Say once per process (rank 0) which fusions a GPU run goes without."""
    from ..runtime import print0

    if not torch.cuda.is_available():
        return
    if not fused_rope_available():
        print0("note: rotary embeddings run unfused (Transformer Engine's fused RoPE does not "
               "import)")

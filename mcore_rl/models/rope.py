"""Llama-3 RoPE frequency scaling with all four HF parameters.

Megatron-Core's RotaryEmbedding only exposes the factor (low/high frequency factors and the
original context are fixed at 1, 4 and 8192), so models with other values get their inverse
frequencies computed here, following transformers' `_compute_llama3_parameters`.
"""

from __future__ import annotations

import math

import torch

from ..config import RopeScalingConfig


def rope_inverse_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """Plain RoPE: 1 / theta^(2i/d) for i < d/2, in fp32."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def llama3_scaled_frequencies(inv_freq: torch.Tensor, scaling: RopeScalingConfig) -> torch.Tensor:
    """Scale long wavelengths by 1/factor, keep short ones, interpolate smoothly in between."""
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = ((scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)

"""Conversion between HuggingFace checkpoints and the canonical full layout of
`mcore_rl.param_layout.sharding` (pure name/shape/config mapping in `architectures/`)."""

from .architectures import ARCHITECTURES, Architecture, architecture_for

__all__ = ["ARCHITECTURES", "Architecture", "architecture_for"]

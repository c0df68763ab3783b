"""Transformer-layer spec: Transformer Engine's fused modules when TE imports, Megatron's local
modules otherwise (with PyTorch's fused attention, models/attention.py). Parameter names differ
only in the fused norms (see param_layout/sharding.py). MoE models take a block spec
(models/moe.py)."""

from __future__ import annotations

import importlib.util

from ..config.lora import LoraConfig


def transformer_engine_available() -> bool:
    """True when transformer_engine can be imported (CUDA builds only)."""
    return importlib.util.find_spec("transformer_engine") is not None


def llama_layer_spec(qk_norm: bool, use_transformer_engine: bool | None = None):
    """The GPT layer spec for a Llama-family block."""
    from megatron.core.models.gpt import gpt_layer_specs

    if use_transformer_engine is None:
        use_transformer_engine = transformer_engine_available()
    if use_transformer_engine:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_norm)
    from .attention import SdpaAttention

    spec = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=qk_norm, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SdpaAttention
    return spec


def decoder_spec(config, qk_norm: bool, moe: bool, lora: LoraConfig | None = None):
    """What GPTModel takes as its transformer_layer_spec: one layer spec for a dense model, the
    block spec (dense and MoE layers, models/moe.py) for a Mixture-of-Experts model. Adapters
    (lora enabled) go on the local spec's linears, also where Transformer Engine imports: its
    fused norm+linear hides the normalised input an adapter reads."""
    if lora is not None and lora.enabled:
        from .lora import with_adapters

        return with_adapters(llama_layer_spec(qk_norm, use_transformer_engine=False), lora)
    if not moe:
        return llama_layer_spec(qk_norm)
    from .moe import moe_block_spec

    use_transformer_engine = transformer_engine_available()
    if use_transformer_engine:
        return moe_block_spec(config, True)
    from .attention import SdpaAttention

    return moe_block_spec(config, False, SdpaAttention)

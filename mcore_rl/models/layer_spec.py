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
    from .norm import with_local_norms

    spec = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=qk_norm, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SdpaAttention
    with_local_norms(spec)
    return spec


def decoder_spec(config, qk_norm: bool, moe: bool, pp_rank: int,
                 lora: LoraConfig | None = None):
    """What GPTModel takes as its transformer_layer_spec: the block spec (the layers of
    pipeline stage `pp_rank` and the final norm) of a dense model, or of a Mixture-of-Experts
    model's dense and MoE layers (models/moe.py). Adapters (lora enabled) go on the local spec's
    linears, also where Transformer Engine imports: its fused norm+linear hides the normalised
    input an adapter reads. Local specs normalise with models/norm.py's RMSNorm (which takes
    sequence parallelism), their final norm too."""
    if moe:
        from .moe import moe_block_spec

        return moe_block_spec(config, transformer_engine_available(), pp_rank, lora)
    if lora is not None and lora.enabled:
        from .lora import with_adapters

        layer = with_adapters(llama_layer_spec(qk_norm, use_transformer_engine=False), lora)
    else:
        layer = llama_layer_spec(qk_norm)
    if transformer_engine_available():
        return layer  # Megatron's block around it, with TE's final norm
    return local_block(config, layer, pp_rank)


def local_block(config, layer_spec, pp_rank: int):
    """The block spec of `layer_spec` repeated over pipeline stage `pp_rank`'s layers, with
    models/norm.py's RMSNorm as the final norm (Megatron's default there is WrappedTorchNorm,
    which refuses sequence parallelism)."""
    from megatron.core.transformer.transformer_block import (TransformerBlockSubmodules,
                                                             get_num_layers_to_build)

    from .norm import RMSNorm

    return TransformerBlockSubmodules(
        layer_specs=[layer_spec] * get_num_layers_to_build(config, pp_rank=pp_rank),
        layer_norm=RMSNorm)

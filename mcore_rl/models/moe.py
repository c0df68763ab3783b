"""Mixture-of-Experts layers in Megatron-Core's GPT model: the decoder block's spec, and the
router used where Transformer Engine is absent.

Megatron-Core 0.16.1's router computes its logits through `RouterGatingLinearFunction`, whose
forward tests a name (`te_general_gemm`) that only exists when Transformer Engine imported: on
a CPU, or a GPU machine without TE, the first MoE forward raises NameError. The router class is
a field of the layer spec (`MoESubmodules.router`), so without TE the spec names
`PlainLinearRouter`: the same TopKRouter with its gating done by a plain linear in the
configured router dtype (no library code is patched). With TE, Megatron's own router runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.router import TopKRouter

from ..config.lora import LoraConfig
from .spec_parts import mlp_submodules

ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


class PlainLinearRouter(TopKRouter):
    """Megatron's top-k router with logits = x . W^T computed by torch (see the module doc)."""

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        dtype = ROUTER_DTYPES.get(self.config.moe_router_dtype, input.dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(input.to(dtype), self.weight.to(dtype), bias)


def moe_block_spec(config, use_transformer_engine: bool, pp_rank: int,
                   lora: LoraConfig | None = None):
    """The decoder block's spec for `config` (dense and MoE layers as config.moe_layer_freq
    lists them, on pipeline stage `pp_rank`). Without Transformer Engine every layer gets the
    local spec's SDPA attention, models/norm.py's RMSNorm (sequence parallelism, which
    Megatron's MoE layer needs at TP > 1) and PlainLinearRouter. The dense and the MoE layer
    spec are each shared by all layers of their kind, so changing one changes them all.
    Adapters (lora enabled) take the local spec, as for dense models (models/lora.py)."""
    adapted = lora is not None and lora.enabled
    use_transformer_engine = use_transformer_engine and not adapted
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=use_transformer_engine,
                                       normalization="RMSNorm", pp_rank=pp_rank)
    if use_transformer_engine:
        return block
    from .attention import SdpaAttention
    from .norm import RMSNorm, with_local_norms

    for layer in block.layer_specs:  # shared specs: a second pass changes nothing
        layer.submodules.self_attention.submodules.core_attention = SdpaAttention
        with_local_norms(layer)
        mlp = mlp_submodules(layer)
        if hasattr(mlp, "router"):
            mlp.router = PlainLinearRouter
    if adapted:
        from .lora import with_adapters

        for layer in {id(layer): layer for layer in block.layer_specs}.values():
            with_adapters(layer, lora)
    block.layer_norm = RMSNorm
    return block

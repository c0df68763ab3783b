"""ModelConfig + layout + precision -> Megatron-Core TransformerConfig.

Kept apart from model construction so that conversion, resharding and inference can build the
same TransformerConfig without building a model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ModelConfig, ParallelConfig
from ..config.runtime import resolve_precision
from .kernels import announce_missing_kernels, fused_rope_available, fused_softmax_available

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def megatron_transformer_config(model: ModelConfig, parallel: ParallelConfig,
                                precision: str = "fp32", random_init: bool = True, **overrides):
    """A TransformerConfig for a Llama-family decoder. random_init=False leaves the weights
    undrawn (the caller loads every weight): Megatron still runs its initialisation code, which
    also marks tensor-parallel parameters (`tensor_model_parallel`, `partition_dim`; gradient
    norms and checkpoints rely on them), with a no-op in place of the random draw. Parameters
    are created on the GPU where there is one (on the CPU otherwise). `overrides` reach
    TransformerConfig unchanged (for example recompute settings)."""
    from megatron.core.transformer import TransformerConfig

    announce_missing_kernels()
    precision = resolve_precision(precision)
    dtype = DTYPES[precision]
    tp = parallel.tensor_model_parallel_size
    fields = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.kv_heads,
        kv_channels=model.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model.qkv_bias,
        qk_layernorm=model.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        apply_rope_fusion=fused_rope_available(),
        masked_softmax_fusion=fused_softmax_available(),
        persist_layer_norm=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        calculate_per_token_loss=True,
        variable_seq_lengths=False,
    )
    if not random_init:
        fields.update(init_method=_left_for_the_load, output_layer_init_method=_left_for_the_load)
    fields.update(overrides)
    return TransformerConfig(**fields)


def _left_for_the_load(weight: torch.Tensor) -> None:
    """An init method that draws nothing: a checkpoint overwrites the weight."""

"""ModelConfig + layout + precision -> Megatron-Core TransformerConfig.

Kept apart from model construction so that conversion, resharding and inference can build the
same TransformerConfig without building a model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ModelConfig, ParallelConfig
from ..config.parallel import pipeline_stage_layers
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
    fields.update(_uneven_pipeline_fields(model, parallel.pipeline_model_parallel_size))
    if model.moe.enabled:
        fields.update(moe_fields(model, parallel))
    if not random_init:
        fields.update(init_method=_left_for_the_load, output_layer_init_method=_left_for_the_load)
    fields.update(overrides)
    return TransformerConfig(**fields)


def _uneven_pipeline_fields(model: ModelConfig, pipeline_parallel: int) -> dict:
    """Megatron's first/last-stage layer counts where the stages hold unequal numbers of layers
    (config.parallel.pipeline_stage_layers: equal middle stages, as Megatron requires)."""
    stages = pipeline_stage_layers(model.num_layers, pipeline_parallel)
    if len(set(stages)) == 1:
        return {}
    return dict(num_layers_in_first_pipeline_stage=stages[0],
                num_layers_in_last_pipeline_stage=stages[-1])


def moe_fields(model: ModelConfig, parallel: ParallelConfig) -> dict:
    """TransformerConfig fields of the MoE layers. Routing equals transformers': softmax over all
    experts then top-k, renormalised (Megatron's pre_softmax=False: softmax over the top-k
    logits, the same numbers) or not (pre_softmax=True: softmax first, no renormalisation).
    Which layers are MoE is an explicit 0/1 list (HF's rule is not Megatron's moe_layer_freq
    integer rule). Grouped GEMM and permute fusion need Transformer Engine / grouped_gemm and
    are left to the GPU path."""
    moe = model.moe
    shared = moe.shared_expert_ffn_hidden_size
    return dict(
        num_moe_experts=moe.num_experts,
        moe_ffn_hidden_size=moe.expert_ffn(model.ffn_hidden_size),
        moe_router_topk=moe.router_topk,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not moe.normalize_topk,
        moe_router_topk_scaling_factor=None,
        moe_router_dtype=None if moe.router_dtype == "model" else moe.router_dtype,
        moe_layer_freq=[int(moe.is_moe_layer(layer)) for layer in range(model.num_layers)],
        moe_router_load_balancing_type="aux_loss" if moe.aux_loss_coeff else "none",
        moe_aux_loss_coeff=moe.aux_loss_coeff,
        moe_z_loss_coeff=moe.z_loss_coeff or None,
        moe_token_dispatcher_type=parallel.moe_token_dispatcher,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_shared_expert_intermediate_size=shared or None,
        moe_shared_expert_gate=moe.shared_expert_gate,
        moe_enable_routing_replay=True,  # routers follow given routes only when told (moe_routing)
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel,
    )


def _left_for_the_load(weight: torch.Tensor) -> None:
    """An init method that draws nothing: a checkpoint overwrites the weight."""

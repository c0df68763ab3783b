"""The architecture of a Llama-family decoder, independent of how it is parallelised.

One `ModelConfig` describes Llama 2/3, SmolLM2, Mistral (no sliding window), Qwen2 (QKV bias) and
Qwen3 (QK-norm), and with `moe` their Mixture-of-Experts siblings (Qwen3-MoE, Qwen2-MoE,
Mixtral: MLPs replaced by routed SwiGLU experts, optionally beside an always-on shared
expert). It is the single source for three consumers that must agree exactly: the
Megatron-Core `TransformerConfig` (models/), the sharding rules (param_layout/sharding.py) and
the HF conversion. Numbers that follow from the fields (head_dim, padded vocab) are properties, so a
config can never hold two values that disagree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from .parallel import pipeline_stage_layers


@dataclass(frozen=True)
class RopeScalingConfig:
    """Llama-3 style RoPE frequency scaling (`rope_scaling` with rope_type "llama3" in HF)."""

    factor: float = 8.0
    """Ratio between the extended and the original context length."""

    low_freq_factor: float = 1.0
    """Wavelengths longer than original_max_position / low_freq_factor are divided by `factor`."""

    high_freq_factor: float = 4.0
    """Wavelengths shorter than original_max_position / high_freq_factor are left unchanged."""

    original_max_position_embeddings: int = 8192
    """Context length the model was pre-trained with before scaling."""


ROUTER_DTYPES = ("model", "fp32", "fp64")


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-Experts MLPs: each token's MLP output is the weighted sum of `router_topk` of
    `num_experts` SwiGLU experts, chosen by a linear router (softmax over all experts, then the
    top k, as transformers' Qwen-MoE and Mixtral route)."""

    num_experts: int = 0
    """Routed experts in each MoE layer; 0: a dense model (no MoE layers)."""

    ffn_hidden_size: Optional[int] = None
    """Width of each expert's gate and up projections; None: model.ffn_hidden_size."""

    router_topk: int = 2
    """Experts each token is sent to."""

    normalize_topk: bool = True
    """Renormalise the top-k routing probabilities to sum to 1 (HF norm_topk_prob; Mixtral
    always); false keeps each expert's probability of the softmax over all experts."""

    dense_layers: tuple[int, ...] = ()
    """Layers (global indices) with a dense MLP of model.ffn_hidden_size instead of experts
    (Qwen-MoE's mlp_only_layers and decoder_sparse_step)."""

    shared_expert_ffn_hidden_size: int = 0
    """Width of an always-on shared expert beside the routed ones (Qwen2-MoE); 0: none."""

    shared_expert_gate: bool = False
    """Scale the shared expert's output by sigmoid(x . w) per token (Qwen2-MoE)."""

    aux_loss_coeff: float = 0.0
    """Load-balancing (auxiliary) loss coefficient per MoE layer (Switch/GShard style, Megatron's
    aux_loss); 0: no load-balancing loss (the usual choice for RL)."""

    z_loss_coeff: float = 0.0
    """Router z-loss coefficient (ST-MoE); 0: none."""

    router_dtype: str = "model"
    """Precision of the router's logits and probabilities: model (as transformers' Qwen-MoE
    computes them: logits in the model's dtype, softmax in fp32), fp32 or fp64."""

    freeze_router: bool = False
    """Leave the router weights untrained (NeMo-RL's default for GRPO on MoE models)."""

    @property
    def enabled(self) -> bool:
        """Whether the model has MoE layers at all."""
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer `layer` routes to experts."""
        return self.enabled and layer not in self.dense_layers

    def expert_ffn(self, model_ffn_hidden_size: int) -> int:
        """The experts' FFN width, with None resolved."""
        return self.ffn_hidden_size or model_ffn_hidden_size

    def errors(self, num_layers: int, tensor_parallel: int,
               expert_tensor_parallel: int | None = None) -> list[str]:
        """Broken rules, each naming its field (empty when valid or dense). The experts' width
        is split over the expert tensor-parallel ranks (None: TP), the shared expert's over
        TP."""
        if not self.enabled:
            return [] if self.num_experts == 0 else [
                f"model.moe.num_experts={self.num_experts} must be >= 0"]
        errors = []
        if not 1 <= self.router_topk <= self.num_experts:
            errors.append(f"model.moe.router_topk={self.router_topk} must be in [1, "
                          f"model.moe.num_experts={self.num_experts}]")
        if self.router_topk == 1 and self.normalize_topk:
            errors.append("model.moe.router_topk=1 with normalize_topk=true gives every token "
                          "weight 1.0, which Megatron's router refuses; set normalize_topk=false")
        outside = [layer for layer in self.dense_layers if not 0 <= layer < num_layers]
        if outside:
            errors.append(f"model.moe.dense_layers={list(self.dense_layers)} names layers outside "
                          f"[0, model.num_layers={num_layers})")
        splits = (("ffn_hidden_size", "expert_tensor_parallel_size",
                   expert_tensor_parallel or tensor_parallel),
                  ("shared_expert_ffn_hidden_size", "tensor_model_parallel_size", tensor_parallel))
        for name, split_name, split in splits:
            width = getattr(self, name) or 0
            if width < 0 or width % split:
                errors.append(f"model.moe.{name}={width} must be >= 0 and divisible by "
                              f"{split_name}={split}")
        if self.shared_expert_gate and not self.shared_expert_ffn_hidden_size:
            errors.append("model.moe.shared_expert_gate=true needs "
                          "model.moe.shared_expert_ffn_hidden_size > 0")
        if self.router_dtype not in ROUTER_DTYPES:
            errors.append(f"model.moe.router_dtype={self.router_dtype!r} must be one of "
                          f"{ROUTER_DTYPES}")
        if self.aux_loss_coeff < 0 or self.z_loss_coeff < 0:
            errors.append(f"model.moe.aux_loss_coeff={self.aux_loss_coeff} and z_loss_coeff="
                          f"{self.z_loss_coeff} must be >= 0")
        return errors

    def expert_parallel_errors(self, expert_parallel: int) -> list[str]:
        """The experts against expert_model_parallel_size (EP ranks split them evenly): the one
        place this rule is written (config, conversion, the planner and sharding ask here)."""
        if expert_parallel == 1:
            return []
        if not self.enabled:
            return [f"expert_model_parallel_size={expert_parallel} needs a Mixture-of-Experts "
                    "model (model.moe.num_experts > 0)"]
        if expert_parallel < 1 or self.num_experts % expert_parallel:
            return [f"model.moe.num_experts={self.num_experts} must be divisible by "
                    f"expert_model_parallel_size={expert_parallel}"]
        return []


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder-only transformer."""

    num_layers: int = 4
    """Number of transformer blocks."""

    hidden_size: int = 128
    """Width of the residual stream."""

    ffn_hidden_size: int = 256
    """Width of each of the SwiGLU gate and up projections."""

    num_attention_heads: int = 4
    """Number of query heads."""

    num_kv_heads: Optional[int] = None
    """Number of key/value heads (grouped-query attention). None means equal to the query heads."""

    head_dim: Optional[int] = None
    """Width of one attention head. None means hidden_size // num_attention_heads."""

    vocab_size: int = 512
    """Number of real tokens in the tokenizer (before any padding for tensor parallelism)."""

    make_vocab_size_divisible_by: int = 128
    """The vocabulary is padded to a multiple of this times the tensor-parallel size."""

    max_position_embeddings: int = 2048
    """Longest sequence the rotary embedding is built for."""

    rope_theta: float = 10000.0
    """RoPE base frequency."""

    rope_scaling: Optional[RopeScalingConfig] = None
    """Llama-3 RoPE scaling; None for plain RoPE."""

    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""

    tie_embeddings: bool = False
    """Share the input embedding with the output (LM head) weight."""

    qkv_bias: bool = False
    """Add a bias to the query, key and value projections (Qwen2)."""

    qk_norm: bool = False
    """RMSNorm each query and key head before RoPE (Qwen3)."""

    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture-of-Experts MLPs (off unless moe.num_experts > 0)."""

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads, with None resolved."""
        return self.num_kv_heads or self.num_attention_heads

    @property
    def kv_channels(self) -> int:
        """Width of one attention head, with None resolved."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def heads_per_kv_group(self) -> int:
        """Query heads that share one key/value head."""
        return self.num_attention_heads // self.kv_heads

    def padded_vocab_size(self, tensor_parallel: int) -> int:
        """Vocabulary rows each layout stores: vocab_size rounded up to a multiple of
        make_vocab_size_divisible_by * tensor_parallel (Megatron's rule)."""
        multiple = self.make_vocab_size_divisible_by * tensor_parallel
        return -(-self.vocab_size // multiple) * multiple

    def check(self, tensor_parallel: int = 1, pipeline_parallel: int = 1,
              expert_parallel: int = 1, expert_tensor_parallel: int | None = None) -> list[str]:
        """Rules this architecture must meet, alone and at a given layout (expert TP None: the
        TP size); returns the broken ones as messages naming the field (an empty list means
        valid)."""
        errors = []
        positive = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                    "vocab_size", "make_vocab_size_divisible_by", "max_position_embeddings")
        for name in positive:
            if getattr(self, name) <= 0:
                errors.append(f"model.{name}={getattr(self, name)} must be positive")
        if errors:
            return errors
        heads, kv = self.num_attention_heads, self.kv_heads
        if kv <= 0 or heads % kv:
            errors.append(f"model.num_kv_heads={kv} must divide model.num_attention_heads={heads}")
        if self.head_dim is None and self.hidden_size % heads:
            errors.append(f"model.hidden_size={self.hidden_size} must be divisible by "
                          f"model.num_attention_heads={heads} when model.head_dim is not set")
        if heads % tensor_parallel:
            errors.append(f"model.num_attention_heads={heads} must be divisible by "
                          f"tensor_model_parallel_size={tensor_parallel}")
        if kv % tensor_parallel and tensor_parallel % kv:
            errors.append(f"model.num_kv_heads={kv} must divide or be divisible by "
                          f"tensor_model_parallel_size={tensor_parallel} (KV heads are split, "
                          "or shared by several TP ranks when fewer than TP)")
        elif (heads + 2 * kv) * self.kv_channels % tensor_parallel:
            errors.append(f"the fused QKV rows (num_attention_heads + 2 x num_kv_heads) x head_dim"
                          f" = {(heads + 2 * kv) * self.kv_channels} must be divisible by "
                          f"tensor_model_parallel_size={tensor_parallel}")
        if self.ffn_hidden_size % tensor_parallel:
            errors.append(f"model.ffn_hidden_size={self.ffn_hidden_size} must be divisible by "
                          f"tensor_model_parallel_size={tensor_parallel}")
        try:
            pipeline_stage_layers(self.num_layers, pipeline_parallel)
        except ValueError as error:
            errors.append(str(error))
        if self.kv_channels % 2:
            errors.append(f"head_dim={self.kv_channels} must be even for rotary embeddings")
        return (errors + self.moe.errors(self.num_layers, tensor_parallel, expert_tensor_parallel)
                + self.moe.expert_parallel_errors(expert_parallel))


@dataclass(frozen=True)
class InitConfig:
    """Where the model's starting weights come from (random initialisation when both are unset).
    Either source also defines the architecture: the `model` section must then stay unset."""

    hf_path: Optional[str] = None
    """An HF checkpoint folder (config.json + safetensors), read directly, no offline step."""

    checkpoint: Optional[str] = None
    """An mcore_rl weights checkpoint (`mcore-rl convert hf-to-mcore` or a training save)."""

    @staticmethod
    def from_path(path: str) -> "InitConfig":
        """`path` as a source: an HF folder when it holds config.json, else an mcore_rl
        checkpoint."""
        if os.path.isfile(os.path.join(path, "config.json")):
            return InitConfig(hf_path=path)
        return InitConfig(checkpoint=path)

"""The tensor half of the Llama-family mapping: which HF tensors build each canonical tensor, with
which shapes, and how q/k/v and gate/up fuse.

Why this module exists
----------------------
Every Llama-family member names its tensors the same way (MoE members differ only in their
`HfMoeLayout`), so the names, the expected shapes and the fusions are written once here and
`Architecture`'s tensor methods are thin. They change together when a tensor is added or
spelled differently; the config.json half (llama_family.py, rope.py, refusals.py) does not.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from mcore_rl.config.model import ModelConfig
from mcore_rl.param_layout import sharding
from mcore_rl.param_layout.sharding import ShardKind

# --------------------------------------------------------------------------------------------
# Tensor names
# --------------------------------------------------------------------------------------------

_LAYER_SOURCES: dict[str, tuple[str, ...]] = {
    "input_layernorm.weight": ("input_layernorm.weight",),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight",),
    "self_attention.linear_qkv.weight": (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "self_attention.linear_qkv.bias": (
        "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight",),
    "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight",),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight",),
    "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight",),
}
"""Canonical per-layer suffix (after ``decoder.layers.{i}.``) -> HF suffixes (after
``model.layers.{i}.``), in fusion order."""

_GLOBAL_SOURCES: dict[str, tuple[str, ...]] = {
    sharding.EMBEDDING: ("model.embed_tokens.weight",),
    sharding.FINAL_NORM: ("model.norm.weight",),
    sharding.OUTPUT_LAYER: ("lm_head.weight",),
}
"""Canonical names outside the layers -> HF names."""

@dataclass(frozen=True)
class HfMoeLayout:
    """Where an HF Mixture-of-Experts architecture keeps its MoE tensors and config fields."""

    block: str = "mlp"
    """The MoE module under ``model.layers.{i}.`` (Mixtral: block_sparse_moe)."""

    projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    """Each expert's gate, up and down projection names (Mixtral: w1, w3, w2)."""

    num_experts_keys: tuple[str, ...] = ("num_experts", "num_local_experts")
    """config.json keys of the expert count; the first present wins, the first is written."""

    expert_ffn_key: str = "moe_intermediate_size"
    """config.json key of the experts' FFN width (Mixtral: intermediate_size)."""

    normalize_key: Optional[str] = "norm_topk_prob"
    """config.json key of the top-k renormalisation; None: always renormalised (Mixtral)."""

    sparse_step_keys: bool = True
    """Dense layers come from decoder_sparse_step and mlp_only_layers (Qwen-MoE)."""

    shared_expert: bool = False
    """An always-on shared expert with a sigmoid gate (Qwen2-MoE)."""

    def layer_sources(self, suffix: str) -> Optional[tuple[str, ...]]:
        """The HF suffixes (after ``model.layers.{i}.``) of canonical MoE suffix `suffix`, or
        None when it is not an MoE tensor."""
        gate, up, down = self.projections
        expert = _CANONICAL_EXPERT.match(suffix)
        if expert:
            index, linear = expert.groups()
            names = (gate, up) if linear == "linear_fc1" else (down,)
            return tuple(f"{self.block}.experts.{index}.{name}.weight" for name in names)
        return {"mlp.router.weight": (f"{self.block}.gate.weight",),
                "mlp.shared_experts.gate_weight": ("mlp.shared_expert_gate.weight",),
                "mlp.shared_experts.linear_fc1.weight": ("mlp.shared_expert.gate_proj.weight",
                                                         "mlp.shared_expert.up_proj.weight"),
                "mlp.shared_experts.linear_fc2.weight": ("mlp.shared_expert.down_proj.weight",),
                }.get(suffix)


_CANONICAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_CANONICAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_HF_ROTARY_BUFFER = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


@functools.lru_cache(maxsize=16)
def _canonical_shapes(model: ModelConfig) -> dict[str, tuple]:
    """`sharding.canonical_param_shapes` for the LM head, cached (it is asked once per tensor)."""
    return sharding.canonical_param_shapes(model, head="lm")


def _canonical_shape(name: str, model: ModelConfig) -> tuple:
    """Shape of canonical tensor `name`; ValueError when this model has no such tensor."""
    shapes = _canonical_shapes(model)
    if name not in shapes:
        raise ValueError(f"{name!r} is not a parameter of this model with an HF counterpart "
                         f"(layers={model.num_layers}, qkv_bias={model.qkv_bias}, "
                         f"qk_norm={model.qk_norm}, tie_embeddings={model.tie_embeddings})")
    return shapes[name]


def _hf_sources(name: str, moe: Optional[HfMoeLayout] = None) -> tuple[str, ...]:
    """The HF tensor names that make up canonical tensor `name`, in fusion order."""
    match = _CANONICAL_LAYER.match(name)
    if match:
        layer, suffix = match.groups()
        sources = (moe and moe.layer_sources(suffix)) or _LAYER_SOURCES[suffix]
        return tuple(f"model.layers.{layer}.{hf}" for hf in sources)
    return _GLOBAL_SOURCES[name]


def _hf_shapes(name: str, model: ModelConfig) -> tuple[tuple, ...]:
    """Expected shape of each HF source of canonical tensor `name` (same order as the sources)."""
    shape = _canonical_shape(name, model)
    kind = sharding.shard_kind(name)
    rest, head_dim = shape[1:], model.kv_channels
    if kind is ShardKind.QKV:
        q_rows, kv_rows = model.num_attention_heads * head_dim, model.kv_heads * head_dim
        return (q_rows, *rest), (kv_rows, *rest), (kv_rows, *rest)
    if kind is ShardKind.GATE_UP:
        return ((shape[0] // 2, *rest),) * 2
    return (shape,)


def _hf_sources_checked(name: str, model: ModelConfig,
                        moe: Optional[HfMoeLayout]) -> tuple[str, ...]:
    """`_hf_sources` after checking that `model` has canonical tensor `name`."""
    _canonical_shape(name, model)
    return _hf_sources(name, moe)


def _gather_sources(name: str, sources: tuple[str, ...], shapes: tuple[tuple, ...],
                    hf_tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The HF source tensors of canonical `name`, checked for presence, shape and one dtype."""
    missing = [source for source in sources if source not in hf_tensors]
    if missing:
        raise ValueError(f"missing HF tensor(s) {missing} needed for canonical {name!r}")
    tensors = [hf_tensors[source] for source in sources]
    for source, tensor, shape in zip(sources, tensors, shapes):
        if tuple(tensor.shape) != shape:
            raise ValueError(f"HF tensor {source!r} has shape {tuple(tensor.shape)}, "
                             f"expected {shape} (for canonical {name!r})")
    dtypes = {tensor.dtype for tensor in tensors}
    if len(dtypes) > 1:
        raise ValueError(f"HF tensors {list(sources)} mix dtypes {sorted(map(str, dtypes))}")
    return tensors


# --------------------------------------------------------------------------------------------
# Tensor fusion
# --------------------------------------------------------------------------------------------

def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             model: ModelConfig) -> torch.Tensor:
    """Megatron's TP=1 fused QKV rows from HF q/k/v (weights [rows, H] or biases [rows]): per KV
    group g, the group's q heads, then k head g, then v head g."""
    groups, rest = model.kv_heads, q.shape[1:]
    per_group = [q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest),
                 v.reshape(groups, -1, *rest)]
    return torch.cat(per_group, dim=1).reshape(-1, *rest).contiguous()


def split_qkv(fused: torch.Tensor, model: ModelConfig) -> tuple[torch.Tensor, ...]:
    """Inverse of `fuse_qkv`: (q, k, v), each a fresh contiguous tensor."""
    head_dim, q_rows = model.kv_channels, model.heads_per_kv_group * model.kv_channels
    rest = fused.shape[1:]
    per_group = fused.reshape(model.kv_heads, q_rows + 2 * head_dim, *rest)
    parts = per_group.split([q_rows, head_dim, head_dim], dim=1)
    return tuple(_fresh(part).reshape(-1, *rest) for part in parts)


def _fresh(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy that shares no storage with `tensor` (safetensors refuses tensors that
    share memory, and split halves of one tensor would)."""
    return tensor.clone(memory_format=torch.contiguous_format)

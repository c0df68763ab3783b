"""The catalogue of a Megatron-Core model's parameters: every canonical name, its full shape and
how it is divided across tensor-parallel ranks (`ShardKind`).

Why this module exists
----------------------
Every other rule of the layout (tensor-parallel cuts, pipeline stages, adapters, whole state
dicts) starts by asking "which parameter is this?". The names, the Transformer-Engine aliases,
the shape of each parameter at TP=1 and the order Megatron creates them in are written once
here; they change together when a model gains a parameter. Pure: no torch, no Megatron.
The layouts themselves are described in `mcore_rl.param_layout.sharding`'s docstring.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from enum import Enum
from typing import Callable

from mcore_rl.config.model import ModelConfig


class ShardKind(str, Enum):
    """How a parameter is divided across tensor-parallel ranks."""

    REPLICATED = "replicated"
    """Every rank holds the whole tensor (norm weights)."""

    COLUMN = "column"
    """Output features (dim 0) are chunked."""

    ROW = "row"
    """Input features (dim 1) are chunked."""

    VOCAB = "vocab"
    """Vocabulary rows (dim 0) are zero-padded to the TP-padded size, then chunked."""

    QKV = "qkv"
    """Fused query/key/value rows of the TP=1 per-group layout, chunked plainly along dim 0 (when
    TP > KV heads a chunk may cut through a group, and Megatron all-gathers the QKV activations in
    forward to rebuild each rank's group)."""

    GATE_UP = "gate_up"
    """Fused SwiGLU [gate; up] rows; each rank holds its chunk of both halves."""



# --------------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------------

_LAYER_PREFIX = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT_INDEX = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.")
EXPERT_PREFIX = "mlp.experts.local_experts.{e}."
"""Per-layer name prefix of expert e's tensors (after ``decoder.layers.{i}.``)."""

_TE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
"""Transformer-Engine per-layer names (suffix after ``decoder.layers.{i}.``) -> local-spec names."""


@dataclass(frozen=True)
class _ParamRule:
    """What is known about one parameter name: its sharding and its canonical full shape."""

    kind: ShardKind
    full_shape: Callable[[ModelConfig], tuple]


def _qkv_rows(m: ModelConfig) -> int:
    """Rows of the fused QKV projection at TP=1: (nq + 2*nkv) * d."""
    return (m.num_attention_heads + 2 * m.kv_heads) * m.kv_channels


_LAYER_RULES: dict[str, _ParamRule] = {
    "input_layernorm.weight": _ParamRule(ShardKind.REPLICATED, lambda m: (m.hidden_size,)),
    "self_attention.linear_proj.weight": _ParamRule(
        ShardKind.ROW, lambda m: (m.hidden_size, m.num_attention_heads * m.kv_channels)),
    "self_attention.linear_qkv.weight": _ParamRule(
        ShardKind.QKV, lambda m: (_qkv_rows(m), m.hidden_size)),
    "self_attention.linear_qkv.bias": _ParamRule(ShardKind.QKV, lambda m: (_qkv_rows(m),)),
    "self_attention.q_layernorm.weight": _ParamRule(
        ShardKind.REPLICATED, lambda m: (m.kv_channels,)),
    "self_attention.k_layernorm.weight": _ParamRule(
        ShardKind.REPLICATED, lambda m: (m.kv_channels,)),
    "pre_mlp_layernorm.weight": _ParamRule(ShardKind.REPLICATED, lambda m: (m.hidden_size,)),
    "mlp.linear_fc1.weight": _ParamRule(
        ShardKind.GATE_UP, lambda m: (2 * m.ffn_hidden_size, m.hidden_size)),
    "mlp.linear_fc2.weight": _ParamRule(
        ShardKind.ROW, lambda m: (m.hidden_size, m.ffn_hidden_size)),
}
"""Per-layer parameters of a dense layer, keyed by the name after ``decoder.layers.{i}.``."""

_ATTENTION_SUFFIXES = tuple(suffix for suffix in _LAYER_RULES if not suffix.startswith("mlp."))


def _expert_ffn(m: ModelConfig) -> int:
    return m.moe.expert_ffn(m.ffn_hidden_size)


_MOE_RULES: dict[str, _ParamRule] = {
    "mlp.router.weight": _ParamRule(
        ShardKind.REPLICATED, lambda m: (m.moe.num_experts, m.hidden_size)),
    EXPERT_PREFIX + "linear_fc1.weight": _ParamRule(
        ShardKind.GATE_UP, lambda m: (2 * _expert_ffn(m), m.hidden_size)),
    EXPERT_PREFIX + "linear_fc2.weight": _ParamRule(
        ShardKind.ROW, lambda m: (m.hidden_size, _expert_ffn(m))),
    "mlp.shared_experts.gate_weight": _ParamRule(
        ShardKind.REPLICATED, lambda m: (1, m.hidden_size)),
    "mlp.shared_experts.linear_fc1.weight": _ParamRule(
        ShardKind.GATE_UP, lambda m: (2 * m.moe.shared_expert_ffn_hidden_size, m.hidden_size)),
    "mlp.shared_experts.linear_fc2.weight": _ParamRule(
        ShardKind.ROW, lambda m: (m.hidden_size, m.moe.shared_expert_ffn_hidden_size)),
}
"""Per-layer parameters of an MoE layer's MLP (expert names with ``{e}`` for the index)."""

_GLOBAL_RULES: dict[str, _ParamRule] = {
    "embedding.word_embeddings.weight": _ParamRule(
        ShardKind.VOCAB, lambda m: (m.vocab_size, m.hidden_size)),
    "decoder.final_layernorm.weight": _ParamRule(ShardKind.REPLICATED, lambda m: (m.hidden_size,)),
    "output_layer.weight": _ParamRule(ShardKind.VOCAB, lambda m: (m.vocab_size, m.hidden_size)),
    "output_layer.scalar_weight": _ParamRule(ShardKind.REPLICATED, lambda m: (1, m.hidden_size)),
}
"""Parameters outside the transformer layers, keyed by full name."""

EMBEDDING = "embedding.word_embeddings.weight"
"""Canonical name of the input embedding (also the source of a tied output layer)."""

OUTPUT_LAYER = "output_layer.weight"
"""Name of the LM head weight."""

SCALAR_HEAD = "output_layer.scalar_weight"
"""Name of the scalar (value / reward) head weight that replaces the LM head (models/heads.py)."""

HEADS = ("lm", "scalar")
"""Output heads: "lm" (vocabulary logits) or "scalar" (one number per position)."""

FINAL_NORM = "decoder.final_layernorm.weight"
"""Name of the norm after the last layer."""


def is_parameter_name(name: str) -> bool:
    """False for state-dict entries that are not parameters (Transformer-Engine/FP8
    ``_extra_state`` buffers); True otherwise."""
    return not name.endswith("_extra_state")


def canonical_name(name: str) -> str:
    """The local-spec spelling of a parameter name: Transformer-Engine fused-norm names are mapped
    to the norm they stand for; every other name is returned unchanged. Layer indices are kept."""
    match = _LAYER_PREFIX.match(name)
    if match and match.group(2) in _TE_ALIASES:
        return f"decoder.layers.{match.group(1)}.{_TE_ALIASES[match.group(2)]}"
    return name


def _rule(name: str) -> _ParamRule:
    """The rule for a (local or global, local-spec or TE) parameter name; ValueError if unknown."""
    name = canonical_name(name)
    match = _LAYER_PREFIX.match(name)
    if match:
        suffix = _EXPERT_INDEX.sub(EXPERT_PREFIX, match.group(2))
        rule = _LAYER_RULES.get(suffix) or _MOE_RULES.get(suffix)
    else:
        rule = _GLOBAL_RULES.get(name)
    if rule is None:
        raise ValueError(f"unknown parameter {name!r}: no sharding rule for it")
    return rule



def _layer_index(name: str) -> int | None:
    """The layer index in ``decoder.layers.{i}.*`` names, None for non-layer names."""
    match = _LAYER_PREFIX.match(name)
    return int(match.group(1)) if match else None


def _with_layer_index(name: str, index: int) -> str:
    """``name`` (a ``decoder.layers.{i}.*`` name) with its layer index replaced."""
    return _LAYER_PREFIX.sub(lambda m: f"decoder.layers.{index}.{m.group(2)}", name)


def shard_kind(name: str) -> ShardKind:
    """How the parameter called ``name`` is split across TP ranks. Accepts local or global layer
    indices and Transformer-Engine names; raises ValueError naming the parameter if unknown."""
    return _rule(name).kind


def full_shape(name: str, model: ModelConfig) -> tuple:
    """Shape of the parameter in the canonical full layout (TP=1, vocab unpadded)."""
    return tuple(_rule(name).full_shape(model))


def canonical_param_shapes(model: ModelConfig, head: str = "lm") -> dict[str, tuple]:
    """Every parameter of the canonical full model -> its shape, in the order of Megatron's
    ``named_parameters()`` at TP=1, PP=1 (embedding, layers, final norm, then the untied LM head
    or the scalar head). A new dict each call, built once per model: planning a 235B MoE asks
    for its ~24k names hundreds of times."""
    return dict(_canonical_param_shapes(model, head))


@functools.lru_cache(maxsize=64)
def _canonical_param_shapes(model: ModelConfig, head: str) -> dict[str, tuple]:
    if head not in HEADS:
        raise ValueError(f"head={head!r} must be one of {HEADS}")
    shapes = {EMBEDDING: full_shape(EMBEDDING, model)}
    for layer in range(model.num_layers):
        for suffix in _layer_suffixes(model, layer):
            name = f"decoder.layers.{layer}.{suffix}"
            shapes[name] = full_shape(name, model)
    shapes[FINAL_NORM] = full_shape(FINAL_NORM, model)
    if head == "scalar":
        shapes[SCALAR_HEAD] = full_shape(SCALAR_HEAD, model)
    elif not model.tie_embeddings:
        shapes[OUTPUT_LAYER] = full_shape(OUTPUT_LAYER, model)
    return shapes


def _layer_suffixes(model: ModelConfig, layer: int) -> list[str]:
    """The parameter names of global layer `layer` after ``decoder.layers.{i}.``, in Megatron's
    named_parameters order: attention, then the dense MLP or the MoE MLP (router, experts in
    index order, shared expert with its gate first)."""
    suffixes = [suffix for suffix in _ATTENTION_SUFFIXES
                if (model.qkv_bias or not suffix.endswith("linear_qkv.bias"))
                and (model.qk_norm or not suffix.endswith(("q_layernorm.weight",
                                                            "k_layernorm.weight")))]
    moe = model.moe
    if not moe.is_moe_layer(layer):
        return suffixes + ["mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
    suffixes.append("mlp.router.weight")
    for expert in range(moe.num_experts):
        prefix = EXPERT_PREFIX.format(e=expert)
        suffixes += [prefix + "linear_fc1.weight", prefix + "linear_fc2.weight"]
    if moe.shared_expert_ffn_hidden_size:
        if moe.shared_expert_gate:
            suffixes.append("mlp.shared_experts.gate_weight")
        suffixes += [f"mlp.shared_experts.linear_fc{i}.weight" for i in (1, 2)]
    return suffixes



def expert_of(name: str) -> int | None:
    """The (global or local) expert index in an expert tensor's name, None for other names."""
    match = _LAYER_PREFIX.match(name)
    expert = _EXPERT_INDEX.match(match.group(2)) if match else None
    return int(expert.group(1)) if expert else None


def _with_expert_index(name: str, index: int) -> str:
    """An expert tensor's name with its expert index replaced."""
    layer, suffix = _LAYER_PREFIX.match(name).groups()
    suffix = _EXPERT_INDEX.sub(EXPERT_PREFIX.format(e=index), suffix)
    return f"decoder.layers.{layer}.{suffix}"

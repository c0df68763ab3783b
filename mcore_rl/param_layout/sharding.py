"""How each Megatron-Core parameter is laid out across tensor- and pipeline-parallel ranks.

Why this module exists
----------------------
Every change of layout in the system - HF checkpoint conversion, resharding trained weights into
vLLM's tensor-parallel layout, merging a distributed checkpoint back into one file - has to
answer the same questions: which rows of which tensor does rank (tp, pp) hold, under which local
name? If two of those paths answered differently, weights would be silently permuted (a wrong
KV head is not an error, just a worse model). So all of them go through the rules written once
here, and this module is pure (torch only: no torch.distributed, no Megatron imports) so the rules
can be tested exhaustively in-process.

The canonical full layout
-------------------------
"Canonical full" means: Megatron-Core GPTModel parameter names of the *local* layer spec at
TP=1, PP=1, with GLOBAL layer indices, and the vocabulary UNPADDED (exactly ``vocab_size`` rows).
With nq query heads, nkv KV heads, head width d, hidden H, FFN width F, vocab V::

    embedding.word_embeddings.weight                      [V, H]             VOCAB
    decoder.layers.{i}.input_layernorm.weight             [H]                REPLICATED
    decoder.layers.{i}.self_attention.linear_proj.weight  [H, nq*d]          ROW
    decoder.layers.{i}.self_attention.linear_qkv.weight   [(nq+2*nkv)*d, H]  QKV
    decoder.layers.{i}.self_attention.linear_qkv.bias     [(nq+2*nkv)*d]     QKV   (qkv_bias)
    decoder.layers.{i}.self_attention.q_layernorm.weight  [d]                REPLICATED (qk_norm)
    decoder.layers.{i}.self_attention.k_layernorm.weight  [d]                REPLICATED (qk_norm)
    decoder.layers.{i}.pre_mlp_layernorm.weight           [H]                REPLICATED
    decoder.layers.{i}.mlp.linear_fc1.weight              [2*F, H]           GATE_UP
    decoder.layers.{i}.mlp.linear_fc2.weight              [H, F]             ROW
    decoder.final_layernorm.weight                        [H]                REPLICATED
    output_layer.weight                                   [V, H]             VOCAB (untied only)

A Mixture-of-Experts layer (model.moe; E experts of FFN width Fe, shared expert width Fs) has,
in place of the two ``mlp.linear_fc*`` tensors::

    decoder.layers.{i}.mlp.router.weight                                 [E, H]    REPLICATED
    decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight   [2*Fe, H] GATE_UP
    decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc2.weight   [H, Fe]   ROW
    decoder.layers.{i}.mlp.shared_experts.gate_weight                    [1, H]    REPLICATED (gate)
    decoder.layers.{i}.mlp.shared_experts.linear_fc1.weight              [2*Fs, H] GATE_UP (Fs > 0)
    decoder.layers.{i}.mlp.shared_experts.linear_fc2.weight              [H, Fs]   ROW     (Fs > 0)

with the GLOBAL expert index e. An expert's matrices are split like the dense MLP's, over the
expert tensor-parallel ranks (ETP; by default the TP ranks, `tensor_split`). Expert parallelism
(EP ranks) is like the pipeline for layers: EP rank r holds experts [r * E/EP, (r + 1) * E/EP)
and numbers them locally from 0.

Transformer-Engine spec names are accepted everywhere and mapped to these: TE fuses the norms into
the following linear, so ``...self_attention.linear_qkv.layer_norm_weight`` is
``...input_layernorm.weight`` and ``...mlp.linear_fc1.layer_norm_weight`` is
``...pre_mlp_layernorm.weight``. State-dict entries ending in ``_extra_state`` are not parameters.

Tensor-parallel layouts (Megatron's real ones)
----------------------------------------------
* QKV, TP=1: for each KV group g: [q heads of group g (nq/nkv heads), k head g, v head g], each
  head d rows. Query head j belongs to group j // (nq/nkv).
* QKV, any TP=t: rank r holds the contiguous dim-0 chunk r of the TP=1 layout (the bias likewise)
  and merging concatenates the chunks; no row is held by two ranks.
  - nkv % t == 0: the chunk is nkv/t whole groups, and Megatron's forward uses it locally.
  - t > nkv (t % nkv == 0, (nq + 2*nkv)*d % t == 0): Megatron is still built with
    num_query_groups = nkv, and a chunk may cut through a group. In forward, Megatron's native
    path (``get_query_key_value_tensors``) all-gathers the mixed QKV activations along the last
    dim on every rank, takes group r // (t/nkv), splits it into q heads, k and v, and keeps that
    group's q heads [s * nq/t, (s + 1) * nq/t) (numbered within the group, s = r % (t/nkv)).
    No parameter is duplicated, so gradients and gradient norms are exact and there are no KV
    copies to keep in sync.
* GATE_UP (fused SwiGLU linear_fc1): TP=1 is cat([gate, up]); rank r holds
  cat([gate chunk r, up chunk r]) so each rank can apply SwiGLU locally.
* COLUMN: chunk dim 0. ROW: chunk dim 1 (partial sums are all-reduced).
* VOCAB: pad [V, H] with zero rows to ``padded_vocab_size(t)``, then chunk dim 0; merging
  concatenates and drops the padding.
* REPLICATED: every rank holds the full tensor.

Pipeline layout
---------------
Stage p owns a run of consecutive global layers (L/P of them when P divides L, otherwise
`config.parallel.pipeline_stage_layers`' uneven split) and numbers them locally from 0. The
embedding is on stage 0; the final norm and output layer on the last stage. With tied embeddings
and P > 1 Megatron also creates ``output_layer.weight`` on the last stage, a copy of the embedding.
"""

from __future__ import annotations

import functools

import re
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Mapping, Sequence

import torch

from mcore_rl.config.model import ModelConfig
from mcore_rl.config.parallel import pipeline_stage_layers


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


# --------------------------------------------------------------------------------------------
# Adapters (LoRA)
# --------------------------------------------------------------------------------------------

ADAPTER_MATRICES = ("lora_a", "lora_b")
"""The two matrices of an adapter, as parameters of their linear: ``<linear>.lora_a`` [r, in]
and ``<linear>.lora_b`` [out, r]."""

_ADAPTER = re.compile(r"^(decoder\.layers\.\d+\.(?:self_attention|mlp|mlp\.shared_experts)"
                      r"\.linear_\w+)\.(lora_a|lora_b)$")


def adapter_of(name: str) -> tuple[str, str] | None:
    """(the adapted linear's weight name, "lora_a" or "lora_b") for an adapter parameter's
    name; None for any other name."""
    match = _ADAPTER.match(name)
    if not match:
        return None
    return f"{match.group(1)}.weight", match.group(2)


def adapted_weights(model: ModelConfig, layer: int, targets: Sequence[str]) -> list[str]:
    """The weights of global layer `layer` that adapters on the Megatron linears `targets`
    adapt: attention's, and the MLP's in a dense layer or the shared expert's in a
    Mixture-of-Experts layer (routed experts take none; models/lora.py)."""
    names = []
    for target in targets:
        if target in ("linear_qkv", "linear_proj"):
            names.append(f"decoder.layers.{layer}.self_attention.{target}.weight")
        elif not model.moe.is_moe_layer(layer):
            names.append(f"decoder.layers.{layer}.mlp.{target}.weight")
        elif model.moe.shared_expert_ffn_hidden_size:
            names.append(f"decoder.layers.{layer}.mlp.shared_experts.{target}.weight")
    return names


def adapter_kind(name: str) -> ShardKind:
    """How adapter parameter ``name`` is split across TP ranks, following its linear: a
    row-parallel linear's A is split on its input columns (B whole); any other linear's B is
    split on its output rows like the linear's weight (A whole)."""
    base, matrix = adapter_of(name)
    kind = shard_kind(base)
    if kind is ShardKind.ROW:
        return ShardKind.ROW if matrix == "lora_a" else ShardKind.REPLICATED
    return ShardKind.REPLICATED if matrix == "lora_a" else kind


def split_adapter(name: str, full: torch.Tensor, tp_size: int, tp_rank: int) -> torch.Tensor:
    """Rank ``tp_rank``'s shard of adapter parameter ``name``'s full tensor."""
    _check_rank(tp_rank, tp_size, "tp_rank")
    return _split(adapter_kind(name), full, tp_size, tp_rank)


def merge_adapter(name: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Adapter parameter ``name``'s full tensor from its shards in TP rank order."""
    return _merge(adapter_kind(name), shards).contiguous()


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


# --------------------------------------------------------------------------------------------
# Tensor parallelism
# --------------------------------------------------------------------------------------------

def _check_layout(model: ModelConfig, tp_size: int, pp_size: int = 1) -> None:
    """Raise ValueError if the model cannot be laid out at this TP/PP size."""
    if tp_size < 1 or pp_size < 1:
        raise ValueError(f"parallel sizes must be positive, got tp_size={tp_size}, "
                         f"pp_size={pp_size}")
    errors = model.check(tp_size, pp_size)
    if errors:
        raise ValueError("; ".join(errors))


def _check_rank(rank: int, size: int, what: str) -> None:
    """Raise ValueError unless 0 <= rank < size."""
    if not 0 <= rank < size:
        raise ValueError(f"{what}={rank} is outside [0, {size})")


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple, what: str) -> None:
    """Raise ValueError naming the tensor and both shapes if ``tensor`` is not ``expected``."""
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"{what} {name!r} has shape {tuple(tensor.shape)}, "
                         f"expected {tuple(expected)}")


def local_shape(name: str, model: ModelConfig, tp_size: int) -> tuple:
    """Shape of one TP rank's shard of parameter ``name`` (the same on every rank)."""
    shape = list(full_shape(name, model))
    kind = shard_kind(name)
    if kind is ShardKind.VOCAB:
        shape[0] = model.padded_vocab_size(tp_size) // tp_size
    elif kind in (ShardKind.COLUMN, ShardKind.GATE_UP, ShardKind.QKV):
        shape[0] //= tp_size
    elif kind is ShardKind.ROW:
        shape[1] //= tp_size
    return tuple(shape)


def _pad_vocab(full: torch.Tensor, model: ModelConfig, tp_size: int) -> torch.Tensor:
    """``full`` ([V, H]) followed by zero rows up to ``padded_vocab_size(tp_size)`` rows."""
    padding = model.padded_vocab_size(tp_size) - full.shape[0]
    return torch.cat([full, full.new_zeros((padding, *full.shape[1:]))], dim=0)


def _split_gate_up(full: torch.Tensor, tp_size: int, tp_rank: int) -> torch.Tensor:
    """Rank ``tp_rank``'s fused fc1 shard: cat([gate chunk, up chunk])."""
    gate, up = full.chunk(2, dim=0)
    return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]])


def _merge_gate_up(shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Inverse of `_split_gate_up`: all gate halves, then all up halves."""
    halves = [shard.chunk(2, dim=0) for shard in shards]
    return torch.cat([gate for gate, _ in halves] + [up for _, up in halves], dim=0)


def split_for_tp(name: str, full: torch.Tensor, model: ModelConfig, tp_size: int,
                 tp_rank: int) -> torch.Tensor:
    """Rank ``tp_rank``'s shard (contiguous) of the canonical full tensor ``full`` of parameter
    ``name``. Raises ValueError naming the parameter if ``full`` has the wrong shape."""
    _check_layout(model, tp_size)
    _check_rank(tp_rank, tp_size, "tp_rank")
    _check_shape(name, full, full_shape(name, model), "full tensor")
    return _split(shard_kind(name), full, tp_size, tp_rank, model)


def _split(kind: ShardKind, full: torch.Tensor, tp_size: int, tp_rank: int,
           model: ModelConfig | None = None) -> torch.Tensor:
    """Rank ``tp_rank``'s contiguous shard of ``full`` split as ``kind`` says (``model`` is
    needed for VOCAB only)."""
    if kind is ShardKind.REPLICATED:
        shard = full
    elif kind is ShardKind.ROW:
        shard = full.chunk(tp_size, dim=1)[tp_rank]
    elif kind is ShardKind.VOCAB:
        shard = _pad_vocab(full, model, tp_size).chunk(tp_size, dim=0)[tp_rank]
    elif kind is ShardKind.GATE_UP:
        shard = _split_gate_up(full, tp_size, tp_rank)
    else:  # COLUMN and QKV
        shard = full.chunk(tp_size, dim=0)[tp_rank]
    return shard.contiguous()


def merge_from_tp(name: str, shards: Sequence[torch.Tensor], model: ModelConfig, tp_size: int,
                  check_replicas: bool = False) -> torch.Tensor:
    """The canonical full tensor of parameter ``name`` from its ``tp_size`` shards (in TP rank
    order). With ``check_replicas``, replicated tensors (norms) must agree across ranks. Raises
    ValueError naming the parameter on a wrong shard count or shape."""
    _check_layout(model, tp_size)
    if len(shards) != tp_size:
        raise ValueError(f"{name!r}: got {len(shards)} shards for tp_size={tp_size}")
    expected = local_shape(name, model, tp_size)
    for rank, shard in enumerate(shards):
        _check_shape(name, shard, expected, f"TP rank {rank} shard of")
    kind = shard_kind(name)
    if kind is ShardKind.REPLICATED and check_replicas:
        for rank, shard in enumerate(shards[1:], start=1):
            if not torch.equal(shard, shards[0]):
                raise ValueError(f"replicated {name!r} differs between TP rank 0 and {rank}")
    return _merge(kind, shards, model)


def _merge(kind: ShardKind, shards: Sequence[torch.Tensor],
           model: ModelConfig | None = None) -> torch.Tensor:
    """Inverse of `_split`: the full tensor from its shards in TP rank order."""
    if kind is ShardKind.REPLICATED:
        full = shards[0]
    elif kind is ShardKind.ROW:
        full = torch.cat(list(shards), dim=1)
    elif kind is ShardKind.VOCAB:
        full = torch.cat(list(shards), dim=0)[: model.vocab_size]
    elif kind is ShardKind.GATE_UP:
        full = _merge_gate_up(shards)
    else:  # COLUMN and QKV
        full = torch.cat(list(shards), dim=0)
    return full.contiguous()


# --------------------------------------------------------------------------------------------
# Pipeline parallelism
# --------------------------------------------------------------------------------------------

def stage_layers(model: ModelConfig, pp_size: int) -> tuple[int, ...]:
    """Transformer layers on each pipeline stage (config.parallel's rule, even when possible)."""
    return pipeline_stage_layers(model.num_layers, pp_size)


def first_layer(model: ModelConfig, pp_size: int, pp_rank: int) -> int:
    """Global index of the first layer on pipeline stage ``pp_rank``."""
    return sum(stage_layers(model, pp_size)[:pp_rank])


def stage_of_layer(global_layer: int, model: ModelConfig, pp_size: int) -> tuple[int, int]:
    """(pipeline stage, local layer index) holding global layer ``global_layer``."""
    if not 0 <= global_layer < model.num_layers:
        raise ValueError(f"layer {global_layer} is outside [0, {model.num_layers})")
    local = global_layer
    for stage, layers in enumerate(stage_layers(model, pp_size)):
        if local < layers:
            return stage, local
        local -= layers
    raise AssertionError("the stages hold every layer")


def _check_known(name: str) -> None:
    """Raise ValueError unless ``name`` is a parameter or an adapter of one."""
    adapter = adapter_of(name)
    _rule(adapter[0] if adapter else name)


def _stage_of_global_param(name: str, pp_size: int) -> int:
    """Pipeline stage that owns non-layer parameter ``name`` (embedding first, head last)."""
    _rule(name)  # raises for unknown names
    return 0 if name.startswith("embedding.") else pp_size - 1


def to_global_name(local_name: str, pp_rank: int, model: ModelConfig, pp_size: int) -> str:
    """The global-index name of ``local_name`` as it appears on stage ``pp_rank``. Only layer
    indices change; the spelling (local spec or TE) is kept."""
    _check_rank(pp_rank, pp_size, "pp_rank")
    on_stage = stage_layers(model, pp_size)[pp_rank]
    _check_known(local_name)
    local = _layer_index(local_name)
    if local is None:
        owner = _stage_of_global_param(local_name, pp_size)
        if owner != pp_rank:
            raise ValueError(f"{local_name!r} lives on pipeline stage {owner}, not {pp_rank}")
        return local_name
    if local >= on_stage:
        raise ValueError(f"{local_name!r}: local layer {local} is outside [0, {on_stage}) on "
                         f"pipeline stage {pp_rank}")
    return _with_layer_index(local_name, first_layer(model, pp_size, pp_rank) + local)


def to_local_name(global_name: str, model: ModelConfig, pp_size: int) -> tuple[int, str]:
    """(pipeline stage, local name) of the global-index name ``global_name``. For a tied model's
    ``output_layer.weight`` this is its last-stage copy."""
    _check_known(global_name)
    layer = _layer_index(global_name)
    if layer is None:
        return _stage_of_global_param(global_name, pp_size), global_name
    pp_rank, local = stage_of_layer(layer, model, pp_size)
    return pp_rank, _with_layer_index(global_name, local)


def has_tied_output_copy(model: ModelConfig, pp_size: int, pp_rank: int,
                         head: str = "lm") -> bool:
    """True on the stage where Megatron keeps ``output_layer.weight`` as a copy of the embedding
    (LM head, tied embeddings, more than one stage, last stage)."""
    return head == "lm" and model.tie_embeddings and pp_size > 1 and pp_rank == pp_size - 1


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


def tensor_split(name: str, tp: tuple[int, int], etp: tuple[int, int] | None) -> tuple[int, int]:
    """(size, rank) of the tensor-parallel split that parameter ``name`` is cut by, given the
    rank's (size, rank) in TP and in expert TP (None: the same as TP). An expert's matrices are
    split over the expert tensor-parallel ranks (Megatron ETP); every other tensor, the shared
    expert's included, over TP."""
    return etp if etp is not None and expert_of(name) is not None else tp


def experts_per_rank(model: ModelConfig, ep_size: int) -> int:
    """Experts each expert-parallel rank holds (they are split evenly)."""
    errors = model.moe.expert_parallel_errors(ep_size)
    if errors:
        raise ValueError(errors[0])
    return model.moe.num_experts // ep_size


def stage_params(model: ModelConfig, pp_size: int, pp_rank: int, head: str = "lm",
                 ep_size: int = 1, ep_rank: int = 0) -> dict[str, str]:
    """Local parameter names on pipeline stage ``pp_rank`` and expert-parallel rank ``ep_rank``
    (in Megatron's named_parameters order) -> the canonical full name each comes from. With
    tied embeddings and P > 1, the last stage's ``output_layer.weight`` maps to
    ``embedding.word_embeddings.weight``."""
    stage_layers(model, pp_size)
    _check_rank(pp_rank, pp_size, "pp_rank")
    _check_rank(ep_rank, ep_size, "ep_rank")
    per_rank = experts_per_rank(model, ep_size) if model.moe.enabled else 0
    params = {}
    for name in canonical_param_shapes(model, head):
        owner, local = to_local_name(name, model, pp_size)
        expert = expert_of(name)
        if expert is not None:
            if expert // per_rank != ep_rank:
                continue
            local = _with_expert_index(local, expert % per_rank)
        if owner == pp_rank:
            params[local] = name
    if has_tied_output_copy(model, pp_size, pp_rank, head):
        params[OUTPUT_LAYER] = EMBEDDING
    return params


# --------------------------------------------------------------------------------------------
# Whole state dicts
# --------------------------------------------------------------------------------------------

def _canonical_state(state: Mapping[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """``state`` without non-parameter entries and with TE names mapped to local-spec names;
    ValueError if two entries map to the same name."""
    result = {}
    for name, tensor in state.items():
        if not is_parameter_name(name):
            continue
        key = canonical_name(name)
        if key in result:
            raise ValueError(f"{where}: {name!r} and another entry both name {key!r}")
        result[key] = tensor
    return result


def shard_full_state(full_state: Mapping[str, torch.Tensor], model: ModelConfig, tp_size: int,
                     pp_size: int, tp_rank: int, pp_rank: int, head: str = "lm",
                     ep_size: int = 1, ep_rank: int = 0,
                     etp: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """The local state (local names -> contiguous shards) of rank (tp_rank, pp_rank, ep_rank),
    cut from a canonical full state; etp: the rank's (size, rank) in expert TP (None: TP's).
    ``full_state`` may hold only some parameters, but must hold every one this stage needs and
    nothing that is not a parameter of this model."""
    _check_layout(model, tp_size, pp_size)
    _check_rank(tp_rank, tp_size, "tp_rank")
    _check_rank(pp_rank, pp_size, "pp_rank")
    state = _canonical_state(full_state, "full state")
    known = canonical_param_shapes(model, head)
    unknown = [name for name in state if name not in known]
    if unknown:
        raise ValueError(f"full state holds names that are not parameters of this model: {unknown}")
    local_state = {}
    for local, source in stage_params(model, pp_size, pp_rank, head, ep_size, ep_rank).items():
        if source not in state:
            raise ValueError(f"full state is missing {source!r} (needed as {local!r} on "
                             f"pipeline stage {pp_rank})")
        local_state[local] = split_for_tp(source, state[source], model,
                                          *tensor_split(source, (tp_size, tp_rank), etp))
    return local_state


def _stage_states(shards_by_rank: Mapping[tuple[int, int], Mapping[str, torch.Tensor]],
                  model: ModelConfig, tp_size: int, pp_size: int, pp_rank: int,
                  head: str) -> list[dict[str, torch.Tensor]]:
    """The canonicalised local states of every TP rank of stage ``pp_rank``, checked to hold
    exactly the stage's parameters."""
    expected = stage_params(model, pp_size, pp_rank, head)
    states = []
    for tp_rank in range(tp_size):
        where = f"rank (tp={tp_rank}, pp={pp_rank})"
        state = _canonical_state(shards_by_rank[(tp_rank, pp_rank)], where)
        missing = [name for name in expected if name not in state]
        extra = [name for name in state if name not in expected]
        if missing or extra:
            raise ValueError(f"{where}: missing parameters {missing}, unexpected {extra}")
        states.append(state)
    return states


def merge_shards(shards_by_rank: Mapping[tuple[int, int], Mapping[str, torch.Tensor]],
                 model: ModelConfig, tp_size: int, pp_size: int,
                 check_replicas: bool = False, head: str = "lm") -> dict[str, torch.Tensor]:
    """The canonical full state from every rank's local state, keyed by (tp_rank, pp_rank).
    A tied model's last-stage output-layer copy is dropped (compared with the embedding when
    ``check_replicas``). The result is ordered like `canonical_param_shapes`."""
    _check_layout(model, tp_size, pp_size)
    grid = {(tp, pp) for tp in range(tp_size) for pp in range(pp_size)}
    if set(shards_by_rank) != grid:
        raise ValueError(f"expected shards for every (tp_rank, pp_rank) in a {tp_size}x{pp_size} "
                         f"grid, got {sorted(shards_by_rank)}")
    merged = {}
    tied_copy = None
    for pp_rank in range(pp_size):
        states = _stage_states(shards_by_rank, model, tp_size, pp_size, pp_rank, head)
        for local, source in stage_params(model, pp_size, pp_rank, head).items():
            full = merge_from_tp(source, [state[local] for state in states], model, tp_size,
                                 check_replicas)
            if local == OUTPUT_LAYER and source == EMBEDDING:
                tied_copy = full
            else:
                merged[source] = full
    if check_replicas and tied_copy is not None and not torch.equal(tied_copy, merged[EMBEDDING]):
        raise ValueError(f"tied {OUTPUT_LAYER!r} on the last pipeline stage differs from "
                         f"{EMBEDDING!r} on the first")
    return {name: merged[name] for name in canonical_param_shapes(model, head)}

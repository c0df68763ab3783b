"""Who holds which rows of which weight, in the training layout and in each rollout layout.

Why this module exists
----------------------
Resharding is only cheap if it is exact about geometry: a rank may skip receiving a row only if
it provably holds that row already. So every layout here describes a rank's tensor as a list of
row intervals of the *canonical* full tensor (mcore_rl.param_layout.sharding: Megatron names, TP=1,
unpadded vocab), concatenated along the parameter's split dimension, plus zero padding rows.
Two layouts then compare by interval arithmetic alone, and the planner never needs to know what
"QKV" or "vocab padding" mean.

Every parameter is split along one dimension in every layout (dim 1 for row-parallel weights,
dim 0 otherwise); a replicated tensor is the single interval covering that dimension.

Rollout layouts
---------------
* ``vllm``: vLLM's tensor-parallel layout. QKVParallelLinear holds, per rank, its query heads,
  then its KV heads, then the same KV heads' values (KV heads replicated when TP > KV heads);
  MergedColumnParallelLinear holds [gate chunk; up chunk]; VocabParallelEmbedding/ParallelLMHead
  pad the vocabulary to a multiple of 64 and split it evenly, padding rows zero; o_proj and
  down_proj are row-parallel; norms replicated. Tensor names are vLLM's parameter names.
  vLLM under ``external_launcher`` forms its TP groups from consecutive global ranks, so rank
  r is rollout TP rank ``r % tp``: the grouping is fixed.
  Mixture-of-Experts layers (no vLLM expert parallelism): the router is ``{block}.gate``
  (replicated), and expert e's rows are slot e of the layer's fused ``w13_weight`` ([gate chunk;
  up chunk], like the dense MLP) and ``w2_weight`` (row-parallel), named
  ``...routed_experts.w13_weight[e]`` here; the engine adapter assembles the slots.
* ``megatron``: Megatron-Core's own layout at the rollout TP, no pipeline (canonical names). Any
  grouping of ranks works, so the planner picks the one that overlaps training shards most.
* ``full``: every rank wants every full tensor (delivery form (a): HF-named full tensors for an
  engine's ``load_weights``).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Iterable

import torch

from mcore_rl.config.model import ModelConfig
from mcore_rl.config.parallel import MEGATRON_DEFAULT_ORDER, with_expert_dimension
from mcore_rl.runtime.layout import ParallelLayout
from mcore_rl.param_layout import sharding
from mcore_rl.param_layout.sharding import ShardKind

ENGINES = ("vllm", "megatron", "full")
"""Rollout layouts: vLLM's TP layout, Megatron's TP layout, full tensors on every rank."""

VLLM_VOCAB_PADDING = 64
"""vLLM pads the vocabulary of VocabParallelEmbedding/ParallelLMHead to a multiple of this
(``DEFAULT_VOCAB_PADDING_SIZE``) before splitting it over TP ranks."""

Interval = tuple[int, int]
"""[start, stop) along a parameter's split dimension, in canonical full coordinates."""


@dataclass(frozen=True)
class ShardSpec:
    """One rank's tensor of one parameter, described against the canonical full tensor."""

    name: str
    """The name the rank uses for the tensor (training local name or engine parameter name)."""

    source: str
    """Canonical full parameter it is cut from."""

    dim: int
    """Dimension along which the tensor is cut (the parameter's split dimension)."""

    pieces: tuple[Interval, ...]
    """Canonical intervals along ``dim``, concatenated in this order."""

    padding: int = 0
    """Zero rows appended along ``dim`` after the pieces (vocabulary padding)."""

    @property
    def length(self) -> int:
        """Extent of the tensor along ``dim``."""
        return sum(stop - start for start, stop in self.pieces) + self.padding

    def shape(self, full_shape: tuple) -> tuple:
        """Shape of this tensor given the canonical full shape."""
        shape = list(full_shape)
        shape[self.dim] = self.length
        return tuple(shape)

    def cut(self, full: torch.Tensor) -> torch.Tensor:
        """This tensor cut from the canonical full tensor ``full`` (a new contiguous tensor)."""
        parts = [full.narrow(self.dim, start, stop - start) for start, stop in self.pieces]
        if self.padding:
            shape = list(full.shape)
            shape[self.dim] = self.padding
            parts.append(full.new_zeros(shape))
        return torch.cat(parts, dim=self.dim).contiguous()

    def placed_pieces(self) -> Iterable[tuple[int, int, int]]:
        """(canonical start, canonical stop, offset in this tensor) per piece."""
        offset = 0
        for start, stop in self.pieces:
            yield start, stop, offset
            offset += stop - start


def split_dim(name: str) -> int:
    """The dimension parameter ``name`` is split along in every layout."""
    return 1 if sharding.shard_kind(name) is ShardKind.ROW else 0


def _chunk(length: int, parts: int, index: int, base: int = 0) -> Interval:
    """Interval ``index`` of ``parts`` equal chunks of [base, base + length)."""
    size = length // parts
    return base + index * size, base + (index + 1) * size


def _merge_adjacent(intervals: Iterable[Interval]) -> tuple[Interval, ...]:
    """Intervals with touching neighbours joined, order kept."""
    merged: list[list[int]] = []
    for start, stop in intervals:
        if merged and merged[-1][1] == start:
            merged[-1][1] = stop
        else:
            merged.append([start, stop])
    return tuple((start, stop) for start, stop in merged)


def _vocab_pieces(vocab: int, padded: int, tp: int,
                  tp_rank: int) -> tuple[tuple[Interval, ...], int]:
    """(pieces, padding) of TP rank ``tp_rank`` when ``vocab`` rows are zero-padded to ``padded``
    and split evenly."""
    start, stop = _chunk(padded, tp, tp_rank)
    real_stop = min(stop, vocab)
    pieces = ((start, real_stop),) if start < real_stop else ()
    return pieces, (stop - start) - max(0, real_stop - start)


def megatron_pieces(name: str, model: ModelConfig, tp: int,
                    tp_rank: int) -> tuple[tuple[Interval, ...], int]:
    """(pieces, padding) of Megatron TP rank ``tp_rank`` for canonical parameter ``name``: the
    same rows `sharding.split_for_tp` cuts."""
    kind = sharding.shard_kind(name)
    full = sharding.full_shape(name, model)
    length = full[split_dim(name)]
    if kind is ShardKind.REPLICATED:
        return ((0, length),), 0
    if kind is ShardKind.VOCAB:
        return _vocab_pieces(model.vocab_size, model.padded_vocab_size(tp), tp, tp_rank)
    if kind is ShardKind.GATE_UP:
        half = length // 2
        return (_chunk(half, tp, tp_rank), _chunk(half, tp, tp_rank, base=half)), 0
    return (_chunk(length, tp, tp_rank),), 0  # COLUMN, ROW, QKV


def vllm_vocab_size(model: ModelConfig) -> int:
    """Rows of vLLM's embedding and LM head: the vocabulary padded to a multiple of 64."""
    return -(-model.vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING


def _vllm_qkv_pieces(model: ModelConfig, tp: int, tp_rank: int) -> tuple[Interval, ...]:
    """Rows of vLLM's QKVParallelLinear on ``tp_rank`` ([its q heads; its k heads; its v heads])
    as intervals of Megatron's per-group fused layout."""
    head_dim, q_per_group = model.kv_channels, model.heads_per_kv_group
    group_rows = (q_per_group + 2) * head_dim
    q_heads = range(*_chunk(model.num_attention_heads, tp, tp_rank))
    if tp >= model.kv_heads:
        kv_heads = [tp_rank // (tp // model.kv_heads)]
    else:
        kv_heads = range(*_chunk(model.kv_heads, tp, tp_rank))

    def rows(group: int, head_in_group: int) -> Interval:
        start = group * group_rows + head_in_group * head_dim
        return start, start + head_dim

    q = [rows(head // q_per_group, head % q_per_group) for head in q_heads]
    k = [rows(group, q_per_group) for group in kv_heads]
    v = [rows(group, q_per_group + 1) for group in kv_heads]
    return _merge_adjacent(q) + _merge_adjacent(k) + _merge_adjacent(v)


def vllm_pieces(name: str, model: ModelConfig, tp: int,
                tp_rank: int) -> tuple[tuple[Interval, ...], int]:
    """(pieces, padding) of vLLM TP rank ``tp_rank`` for canonical parameter ``name``."""
    kind = sharding.shard_kind(name)
    if kind is ShardKind.QKV:
        return _vllm_qkv_pieces(model, tp, tp_rank), 0
    if kind is ShardKind.VOCAB:
        return _vocab_pieces(model.vocab_size, vllm_vocab_size(model), tp, tp_rank)
    return megatron_pieces(name, model, tp, tp_rank)


# --------------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------------

_VLLM_LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.weight": "self_attn.qkv_proj.weight",
    "self_attention.linear_qkv.bias": "self_attn.qkv_proj.bias",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.weight": "mlp.gate_up_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
"""Canonical per-layer suffix -> vLLM Llama-family parameter suffix."""

_VLLM_MOE_NAMES = {
    "mlp.router.weight": "{block}.gate.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
    "mlp.shared_experts.linear_fc1.weight": "mlp.shared_expert.gate_up_proj.weight",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_expert.down_proj.weight",
}
"""Canonical MoE suffix -> vLLM suffix; ``{block}`` is the MoE module (mlp, Mixtral's
block_sparse_moe)."""

_VLLM_EXPERT = {"linear_fc1": "w13_weight", "linear_fc2": "w2_weight"}
"""Expert linear -> vLLM's fused parameter holding every expert of a layer."""

_VLLM_GLOBAL_NAMES = {
    sharding.EMBEDDING: "model.embed_tokens.weight",
    sharding.FINAL_NORM: "model.norm.weight",
    sharding.OUTPUT_LAYER: "lm_head.weight",
}
"""Canonical non-layer name -> vLLM Llama-family parameter name."""

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
VLLM_EXPERT_SLOT = re.compile(r"^(.+)\[(\d+)\]$")
"""An expert's slot in a fused vLLM parameter: ``<parameter name>[<expert>]``."""


def vllm_name(canonical: str, moe_block: str = "mlp") -> str:
    """vLLM's name for canonical parameter ``canonical`` in the Llama family (Llama, Qwen2,
    Qwen3, Mistral) and its MoE members (Qwen3-MoE, Qwen2-MoE; Mixtral with ``moe_block``
    block_sparse_moe). An expert's tensor is a slot of its layer's fused parameter."""
    match = _LAYER.match(canonical)
    if not match:
        return _VLLM_GLOBAL_NAMES[canonical]
    layer, suffix = match.groups()
    expert = _EXPERT.match(suffix)
    if expert:
        index, linear = expert.groups()
        return (f"model.layers.{layer}.{moe_block}.experts.routed_experts."
                f"{_VLLM_EXPERT[linear]}[{index}]")
    if suffix in _VLLM_MOE_NAMES:
        return f"model.layers.{layer}.{_VLLM_MOE_NAMES[suffix].format(block=moe_block)}"
    return f"model.layers.{layer}.{_VLLM_LAYER_NAMES[suffix]}"


# --------------------------------------------------------------------------------------------
# Layouts
# --------------------------------------------------------------------------------------------

DEFAULT_ORDER = tuple(MEGATRON_DEFAULT_ORDER.split("-"))
"""Megatron-Core's default rank order: TP varies fastest over consecutive ranks, then DP, then
PP."""


def layout_order(megatron_order: str) -> tuple[str, ...]:
    """The TP/DP/PP order of Megatron's ``order`` string. With expert parallelism Megatron's
    order has "ep" just before "dp" (config.parallel): EP ranks are then the data-parallel
    coordinate modulo EP, which `TrainingLayout` derives, so the layout keeps three names. With
    context parallelism "cp" sits just before them: CP ranks hold the same weights, so "dp"
    here counts DP x CP replicas."""
    return tuple(name for name in megatron_order.split("-") if name not in ("ep", "cp"))


@dataclass(frozen=True)
class TrainingLayout:
    """Megatron-Core's training layout TP x PP x DP over ranks 0..world-1, in a rank order
    (Megatron's ``order``: the dimension varying fastest over consecutive ranks first), with
    MoE experts split over EP of the DP ranks (expert-parallel rank = DP rank mod EP)."""

    model: ModelConfig
    """The model being trained (LM head)."""

    tp: int
    """Training tensor-parallel size."""

    pp: int
    """Training pipeline-parallel size."""

    dp: int
    """Training data-parallel size."""

    order: tuple[str, ...] = DEFAULT_ORDER
    """A permutation of ("tp", "dp", "pp"), fastest-varying first."""

    ep: int = 1
    """Expert-parallel size: at ETP = TP the DP ranks d with equal d mod EP hold the same
    experts."""

    etp: int | None = None
    """Expert tensor-parallel size (None: TP). Other values lay the experts over Megatron's
    expert grid (runtime.layout)."""

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def megatron_order(self) -> str:
        """The order as Megatron's `initialize_model_parallel(order=...)` takes it."""
        return "-".join(self.order)

    @functools.cached_property
    def grid(self) -> ParallelLayout:
        """Both of Megatron's grids over these ranks (dense and expert coordinates)."""
        return ParallelLayout(self.tp, self.pp, self.dp, ep=self.ep, etp=self.etp,
                              order=with_expert_dimension(self.megatron_order))

    def errors(self) -> list[str]:
        """Broken rules of this layout (empty when valid)."""
        errors = [f"training layout: {error}"
                  for error in self.model.check(self.tp, self.pp, self.ep, self.etp)
                  + self.grid.errors()]
        if sorted(self.order) != sorted(DEFAULT_ORDER):
            errors.append(f"training layout: rank order {self.megatron_order!r} must be a "
                          f"permutation of tp, dp and pp")
        return errors

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, pp_rank, dp_rank) of global ``rank``."""
        position = self.grid.position(rank)
        return position.tp_rank, position.pp_rank, position.dp_rank

    def rank_of(self, tp_rank: int, pp_rank: int, dp_rank: int) -> int:
        """Global rank at these coordinates (inverse of `coordinates`)."""
        return self.grid.rank_of(tp_rank, pp_rank, dp_rank)

    def holding(self, rank: int) -> tuple[int, int, int, int]:
        """(tp_rank, pp_rank, ep_rank, etp_rank): what decides which shards ``rank`` holds."""
        position = self.grid.position(rank)
        return position.tp_rank, position.pp_rank, position.ep_rank, position.etp_rank

    def held(self, rank: int) -> dict[str, ShardSpec]:
        """Canonical source -> the shard this rank's model stage holds (local names). A tied
        model's last-stage ``output_layer.weight`` copy is keyed by the embedding it copies.
        Ranks after the training ranks (rollout-only ranks in split placement) hold nothing."""
        if rank >= self.world_size:
            return {}
        return _training_held(self.model, self.tp, self.pp, self.ep, self.grid.expert_tp,
                              *self.holding(rank))


@functools.lru_cache(maxsize=4096)
def _training_held(model: ModelConfig, tp: int, pp: int, ep: int, etp: int, tp_rank: int,
                   pp_rank: int, ep_rank: int, etp_rank: int) -> dict[str, ShardSpec]:
    held = {}
    for local, source in sharding.stage_params(model, pp, pp_rank, "lm", ep, ep_rank).items():
        pieces, padding = megatron_pieces(
            source, model, *sharding.tensor_split(source, (tp, tp_rank), (etp, etp_rank)))
        held[source] = ShardSpec(local, source, split_dim(source), pieces, padding)
    return held


@dataclass(frozen=True)
class RolloutLayout:
    """A rollout engine's layout: TP x DP, no pipeline, over the training ranks (colocated
    placement) or over the ranks after them (split placement). Ranks are job ranks."""

    model: ModelConfig
    """The model being served."""

    engine: str
    """One of ENGINES."""

    tp: int
    """Rollout tensor-parallel size (ignored by the ``full`` layout: every rank holds all)."""

    tp_rank_of: tuple[int, ...]
    """Rollout TP rank of every global rank."""

    dp_rank_of: tuple[int, ...]
    """Rollout DP rank (which engine replica) of every rank of the layout."""

    first_rank: int = 0
    """Job rank of the layout's first rank: 0 when colocated, the number of training ranks in
    split placement (the engine runs on the last ranks of the job)."""

    moe_block: str = "mlp"
    """The module holding an MoE layer's router and experts in the engine's names (vLLM's
    Mixtral: block_sparse_moe)."""

    expert_parallel: bool = False
    """vLLM's expert parallelism: engine rank dp_rank x TP + tp_rank of DP x TP holds that
    block of the experts whole (slots numbered locally, as vLLM's linear placement), instead
    of a TP slice of every expert."""

    @property
    def world_size(self) -> int:
        """Ranks that run the engine."""
        return len(self.tp_rank_of)

    @property
    def ranks(self) -> range:
        """Job ranks that run the engine."""
        return range(self.first_rank, self.first_rank + self.world_size)

    @property
    def dp(self) -> int:
        return self.world_size // self.tp

    def wanted(self, rank: int) -> dict[str, ShardSpec]:
        """Canonical source -> the shard job rank ``rank``'s engine part needs (engine names;
        nothing on a rank that runs no engine)."""
        if rank not in self.ranks:
            return {}
        return _rollout_wanted(self.model, self.engine, self.tp, *self.shard_key(rank),
                               self.moe_block)

    def shard_key(self, rank: int) -> tuple[int, tuple[int, int] | None]:
        """What decides engine rank ``rank``'s shards: its TP rank and, with expert
        parallelism, its (EP size, EP rank) in vLLM's flattened DP x TP numbering."""
        index = rank - self.first_rank
        tp_rank = self.tp_rank_of[index]
        if not self.expert_parallel:
            return tp_rank, None
        return tp_rank, (self.world_size, self.dp_rank_of[index] * self.tp + tp_rank)

    def group_ranks(self) -> list[list[int]]:
        """Job ranks of every rollout TP group, by DP rank, each in TP-rank order."""
        groups = [[0] * self.tp for _ in range(self.dp)]
        for rank, tp_rank, dp_rank in zip(self.ranks, self.tp_rank_of, self.dp_rank_of):
            groups[dp_rank][tp_rank] = rank
        return groups


@functools.lru_cache(maxsize=4096)
def _rollout_wanted(model: ModelConfig, engine: str, tp: int, tp_rank: int,
                    experts: tuple[int, int] | None, moe_block: str) -> dict[str, ShardSpec]:
    """experts: (EP size, EP rank) of vLLM's expert parallelism, None without it."""
    wanted = {}
    served = _served_experts(model, *experts) if experts else {}
    for source, shape in sharding.canonical_param_shapes(model).items():
        dim = split_dim(source)
        if experts and sharding.expert_of(source) is not None:
            if source in served:
                wanted[source] = ShardSpec(vllm_name(served[source], moe_block), source, dim,
                                           ((0, shape[dim]),))
        elif engine == "full":
            wanted[source] = ShardSpec(source, source, dim, ((0, shape[dim]),))
        elif engine == "vllm":
            pieces, padding = vllm_pieces(source, model, tp, tp_rank)
            wanted[source] = ShardSpec(vllm_name(source, moe_block), source, dim, pieces,
                                       padding)
        else:
            pieces, padding = megatron_pieces(source, model, tp, tp_rank)
            wanted[source] = ShardSpec(source, source, dim, pieces, padding)
    return wanted


def _served_experts(model: ModelConfig, ep_size: int, ep_rank: int) -> dict[str, str]:
    """Canonical expert tensor -> its name with the local slot index, for the experts vLLM's
    expert-parallel rank ``ep_rank`` of ``ep_size`` serves (its linear placement: a block of
    num_experts / ep_size, like Megatron's EP)."""
    local_names = sharding.stage_params(model, 1, 0, "lm", ep_size, ep_rank)
    return {canonical: local for local, canonical in local_names.items()
            if sharding.expert_of(canonical) is not None}


def rollout_errors(model: ModelConfig, engine: str, tp: int, world_size: int) -> list[str]:
    """Why a rollout layout cannot be built (empty when it can)."""
    if engine not in ENGINES:
        return [f"rollout engine {engine!r} must be one of {ENGINES}"]
    if tp < 1 or world_size % tp:
        return [f"rollout tensor-parallel size {tp} must divide the world size {world_size}"]
    if engine == "full":
        return []
    errors = [f"rollout layout: {error}" for error in model.check(tp, 1)]
    if engine == "vllm" and vllm_vocab_size(model) % tp:
        errors.append(f"rollout layout: vLLM pads vocab_size={model.vocab_size} to "
                      f"{vllm_vocab_size(model)} rows (a multiple of {VLLM_VOCAB_PADDING}), "
                      f"which rollout tensor-parallel size {tp} must divide")
    return errors


def consecutive_grouping(world_size: int, tp: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(tp_rank_of, dp_rank_of) when TP groups are consecutive ranks (vLLM's fixed grouping)."""
    ranks = range(world_size)
    return tuple(rank % tp for rank in ranks), tuple(rank // tp for rank in ranks)

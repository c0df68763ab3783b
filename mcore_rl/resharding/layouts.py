"""Who holds which rows of which weight: the training layout and each rollout layout.

Why this module exists
----------------------
The planner (plan.py) compares two layouts: what every training rank holds (`TrainingLayout`,
Megatron's TP x PP x DP grid with its experts) and what every rollout rank's engine part needs
(`RolloutLayout`). Each describes a rank's tensor of a parameter as rows of the canonical full
tensor (shards.py), so the two compare by interval arithmetic alone.

The rollout layout is also *the* answer to "which engine instance is this rank, and which ranks
form it": it is built once (with the resharding plan), and the engine and the split placement's
rollout ranks take their grouping from it instead of deriving it again.

Rollout layouts
---------------
* ``vllm``: vLLM's tensor-parallel layout (vllm_shards.py), under vLLM's parameter names. vLLM
  under ``external_launcher`` forms its TP groups from consecutive ranks, so engine rank r is
  rollout TP rank ``r % tp`` of instance ``r // tp``: the grouping is fixed
  (`RolloutLayout.consecutive`, the one place that rule is written).
* ``megatron``: Megatron-Core's own layout at the rollout TP, no pipeline (canonical names). Any
  grouping of ranks works, so the planner picks the one that overlaps training shards most
  (grouping.py).
* ``full``: every rank wants every full tensor (delivery form (a): HF-named full tensors for an
  engine's ``load_weights``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from mcore_rl.config.model import ModelConfig
from mcore_rl.config.parallel import MEGATRON_DEFAULT_ORDER, with_expert_dimension
from mcore_rl.runtime.layout import ParallelLayout
from mcore_rl.param_layout import sharding

from .shards import ShardSpec, megatron_pieces, split_dim
from .vllm_shards import VLLM_VOCAB_PADDING, vllm_name, vllm_pieces, vllm_vocab_size

ENGINES = ("vllm", "megatron", "full")
"""Rollout layouts: vLLM's TP layout, Megatron's TP layout, full tensors on every rank."""


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
    def instances(self) -> int:
        """Engine instances (the rollout DP size): groups of `tp` ranks, each serving the whole
        model. The same number as `JobConfig.engine_instances`, the config's count."""
        return self.world_size // self.tp

    @property
    def split(self) -> bool:
        """Whether the engine runs on ranks of its own (split placement), after the trainers."""
        return self.first_rank > 0

    @classmethod
    def consecutive(cls, model: ModelConfig, engine: str, tp: int, world_size: int,
                    first_rank: int = 0, moe_block: str = "mlp",
                    expert_parallel: bool = False) -> "RolloutLayout":
        """The layout whose instances are `tp` consecutive ranks: engine rank r (counted from
        `first_rank`) is TP rank r % tp of instance r // tp. vLLM's grouping under
        ``external_launcher`` (fixed: vLLM forms its groups so), and the one of split
        placement's rollout ranks (they hold no training shard to overlap)."""
        ranks = range(world_size)
        return cls(model, engine, tp, tuple(rank % tp for rank in ranks),
                   tuple(rank // tp for rank in ranks), first_rank, moe_block, expert_parallel)

    def engine_rank(self, rank: int) -> int:
        """Job rank `rank`'s place among the engine's ranks (its rank in the engine's world:
        the rollout side's in split placement)."""
        return rank - self.first_rank

    def job_rank(self, engine_rank: int) -> int:
        """The job rank at place `engine_rank` of the engine's world (`engine_rank`'s inverse)."""
        return self.ranks[engine_rank]

    def instance_of(self, rank: int) -> int:
        """The engine instance (rollout DP rank) job rank `rank` is part of."""
        return self.dp_rank_of[self.engine_rank(rank)]

    def instance_ranks(self, instance: int) -> list[int]:
        """Job ranks of engine instance `instance`, in TP-rank order."""
        return self.group_ranks()[instance]

    def is_leader(self, rank: int) -> bool:
        """Whether job rank `rank` is its instance's first rank (TP rank 0): the one that acts
        for the instance (split placement: scores and sends its shares)."""
        return self.tp_rank_of[self.engine_rank(rank)] == 0

    def prompt_shard_key(self, rank: int, data_shard: int | None) -> int:
        """The key job rank `rank` pools its prompts under with the rest of its instance (ranks
        with equal keys bring the same prompts; the key also seeds them). Split placement deals
        prompts out per instance, so the instance; colocated, each rank brings its own training
        data shard, `data_shard` (TP peers of one data-parallel rank bring the same)."""
        if self.split:
            return self.instance_of(rank)
        if data_shard is None:
            raise ValueError("a colocated engine needs its rank's training data shard")
        return data_shard

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
        index = self.engine_rank(rank)
        tp_rank = self.tp_rank_of[index]
        if not self.expert_parallel:
            return tp_rank, None
        return tp_rank, (self.world_size, self.dp_rank_of[index] * self.tp + tp_rank)

    def group_ranks(self) -> list[list[int]]:
        """Job ranks of every rollout TP group, by DP rank, each in TP-rank order."""
        groups = [[0] * self.tp for _ in range(self.instances)]
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


"""How the training world is split: tensor x pipeline x (context) x data parallel.

The data-parallel size is not a field: it is whatever the world size leaves after the model
parallel dimensions, so it can never disagree with the launcher (`data_parallel_size(world)`).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import permutations
from typing import Optional

MEGATRON_DEFAULT_ORDER = "tp-dp-pp"
"""Megatron-Core's default rank order (tp-cp-ep-dp-pp with CP = EP = 1): TP varies fastest."""

AUTO_ORDER = "auto"

MOE_TOKEN_DISPATCHERS = ("alltoall", "allgather")


def pipeline_stage_layers(num_layers: int, pipeline_parallel: int) -> tuple[int, ...]:
    """Transformer layers on each pipeline stage, first stage first: the one rule every part of
    the package (Megatron's model, checkpoints, conversion, resharding) splits layers by.

    Even when the stages divide the layers. Otherwise the middle stages hold ceil(layers /
    stages) each (fewer while that would leave the end stages less than one layer each) and
    the first and last stages share the rest, the last taking the smaller half: it also computes
    the output layer and the loss. 94 layers at PP4: 23, 24, 24, 23; 5 at PP2: 3, 2. This is
    Megatron's uneven split (`num_layers_in_first/last_pipeline_stage`): middle stages equal."""
    if pipeline_parallel < 1 or num_layers < pipeline_parallel:
        raise ValueError(f"model.num_layers={num_layers} must be at least "
                         f"pipeline_model_parallel_size={pipeline_parallel} (no stage may be "
                         "empty)")
    if num_layers % pipeline_parallel == 0 or pipeline_parallel == 1:
        return (num_layers // pipeline_parallel,) * pipeline_parallel
    middle_stages = pipeline_parallel - 2
    per_middle = -(-num_layers // pipeline_parallel)
    while num_layers - per_middle * middle_stages < 2:
        per_middle -= 1
    ends = num_layers - per_middle * middle_stages
    return (ends - ends // 2, *(per_middle,) * middle_stages, ends // 2)


def with_expert_dimension(order: str) -> str:
    """Megatron's order string with "ep" just before "dp": the EP ranks of an expert group are
    then consecutive among the ranks of a stage's expert grid (Megatron's own default,
    tp-cp-ep-dp-pp, places it there too)."""
    return order if "ep" in order.split("-") else order.replace("dp", "ep-dp")


def with_context_dimension(order: str) -> str:
    """Megatron's order string with "cp" just before "dp" (Megatron's own default,
    tp-cp-ep-dp-pp, places it there): a data shard's CP ranks are then neighbours, and a layout
    that ignores CP (resharding: CP ranks hold the same weights) reads DP x CP as one
    replica dimension."""
    return order if "cp" in order.split("-") else order.replace("dp", "cp-dp")


def expert_grid_errors(expert_parallel: int, expert_tensor_parallel: int,
                       stage_ranks: int) -> list[str]:
    """Megatron lays the experts over the ranks of each pipeline stage as a second grid,
    expert TP x EP x expert DP: EP x ETP must divide those ranks (at ETP = TP, "EP divides the
    data-parallel size"). The one place this rule is written; the planner's layouts and the
    converters ask here too."""
    if stage_ranks % (expert_parallel * expert_tensor_parallel):
        return [f"parallel.expert_model_parallel_size={expert_parallel} x "
                f"expert_tensor_parallel_size={expert_tensor_parallel} must divide the "
                f"{stage_ranks} ranks of a pipeline stage (tensor x context x data parallel)"]
    return []


@dataclass(frozen=True)
class ParallelConfig:
    """Training layout of the actor/critic models over the ranks of one torchrun/srun world."""

    tensor_model_parallel_size: int = 1
    """Ranks that split every layer's matrices (Megatron TP)."""

    pipeline_model_parallel_size: int = 1
    """Ranks that split the layers into consecutive stages (Megatron PP). Stages need not divide
    the layers: `pipeline_stage_layers` then gives the first and last stages fewer (94 layers at
    PP4: 23, 24, 24, 23)."""

    context_parallel_size: int = 1
    """Ranks that split every sequence (Megatron CP, for long sequences): each holds two of
    2 x CP chunks (load-balanced for causal attention) and the activations of those positions
    only; weights are replicated like data parallelism's. Micro-batches are padded to a
    multiple of 2 x CP positions (x TP with sequence parallelism). Attention through
    Transformer Engine's CP when it imports, else models/context_parallel.py."""

    expert_model_parallel_size: int = 1
    """Ranks that split MoE experts (Megatron EP): each holds model.moe.num_experts / EP of them,
    and tokens travel to their experts all-to-all. At ETP = TP it must divide the data-parallel
    size."""

    expert_tensor_parallel_size: Optional[int] = None
    """Ranks that split each expert's matrices (Megatron ETP). None: the TP size (experts split
    like the dense MLP). Another value lays the experts over a grid of their own, ETP x EP x
    expert DP over each stage's ranks (Qwen3-30B-A3B recipes: attention TP4, experts ETP1 x
    EP8); EP x ETP must divide TP x CP x DP."""

    moe_token_dispatcher: str = "alltoall"
    """How MoE tokens reach experts held by other EP ranks (Megatron's token dispatcher):
    alltoall (each rank sends every expert's tokens to its holder) or allgather (every rank
    gathers all tokens and keeps those of its experts)."""

    sequence_parallel: bool = False
    """Shard activations along the sequence inside TP regions (needs TP > 1)."""

    rank_order: str = AUTO_ORDER
    """How the TP, DP and PP coordinates map onto consecutive ranks, fastest-varying first, as
    Megatron's `order` (tp-dp-pp is Megatron's default). auto: an RL job generating with vLLM
    picks the order that moves the fewest bytes to vLLM's tensor-parallel groups (consecutive
    ranks) while keeping each training TP group inside a node; other jobs use tp-dp-pp."""

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one complete copy of the model."""
        return (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                * self.context_parallel_size)

    @property
    def expert_tensor_parallel(self) -> int:
        """The expert tensor-parallel size in effect (the TP size when unset)."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        """Model replicas in a world of this size."""
        return world_size // self.model_parallel_size

    def megatron_order(self) -> str:
        """The rank order Megatron is initialised with (auto still unresolved: the default).
        With expert parallelism Megatron's expert ranks need "ep" in it: the EP ranks of an
        expert group are then consecutive among the data-parallel ranks (Megatron's own
        default, tp-cp-ep-dp-pp, places it there too)."""
        order = MEGATRON_DEFAULT_ORDER if self.rank_order == AUTO_ORDER else self.rank_order
        if self.context_parallel_size > 1:
            order = with_context_dimension(order)
        return with_expert_dimension(order) if self.expert_model_parallel_size > 1 else order

    def check(self, world_size: int, world_name: str = "") -> list[str]:
        """Broken layout rules as messages naming the field (empty when valid). world_name:
        what the ranks are, when not the whole world (split placement's trainer ranks)."""
        errors = []
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "context_parallel_size", "expert_model_parallel_size"):
            if getattr(self, name) < 1:
                errors.append(f"parallel.{name}={getattr(self, name)} must be >= 1")
        if errors:
            return errors
        orders = ["-".join(order) for order in permutations(MEGATRON_DEFAULT_ORDER.split("-"))]
        if self.rank_order not in (AUTO_ORDER, *orders):
            errors.append(f"parallel.rank_order={self.rank_order!r} must be auto or one of "
                          f"{', '.join(orders)}")
        etp = self.expert_tensor_parallel_size
        if etp is not None and etp < 1:
            errors.append(f"parallel.expert_tensor_parallel_size={etp} must be >= 1 or unset")
            return errors
        if self.moe_token_dispatcher not in MOE_TOKEN_DISPATCHERS:
            errors.append(f"parallel.moe_token_dispatcher={self.moe_token_dispatcher!r} must be "
                          f"one of {MOE_TOKEN_DISPATCHERS}")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            errors.append("parallel.sequence_parallel=true needs tensor_model_parallel_size > 1")
        if world_size % self.model_parallel_size == 0:
            errors += expert_grid_errors(self.expert_model_parallel_size,
                                         self.expert_tensor_parallel,
                                         world_size // self.pipeline_model_parallel_size)
        else:
            errors.append(
                f"{world_name or f'world size {world_size}'} must be divisible by "
                f"tensor_model_parallel_size x "
                f"pipeline_model_parallel_size x context_parallel_size = {self.model_parallel_size}")
        return errors

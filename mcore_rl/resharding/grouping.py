"""Choosing the rollout layout: which ranks form each engine instance, and with which TP rank.

Why this module exists
----------------------
A rollout layout's grouping is a choice only for the Megatron engine, colocated: any grouping
works there, so the one whose shards overlap the training shards most is taken (fewest bytes to
move). vLLM's grouping is fixed (consecutive ranks, `RolloutLayout.consecutive`), and so is the
grouping of split placement's rollout ranks, which hold no training shard. The choice reads the
plan's arithmetic (`lacking_elements`), so it sits above plan.py; the layout it returns is built
once per job and carried from there (to the plan, the engine and the rollout ranks).
"""

from __future__ import annotations

from .layouts import RolloutLayout, TrainingLayout, rollout_errors
from .plan import PlanError, lacking_elements


def _planned_grouping(training: TrainingLayout, engine: str, tp: int,
                      gpus_per_node: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A rollout grouping that keeps every TP group inside a node (or inside ``tp`` consecutive
    ranks when a group is larger than a node) and, within each such block, gives each rank the
    rollout TP rank whose shard it lacks least of (greedy, each TP rank used equally often)."""
    world = training.world_size
    block_size = max(tp, min(gpus_per_node, world))
    if block_size % tp or world % block_size:
        block_size = tp
    probes = {k: RolloutLayout(training.model, engine, tp, (k,) * world, (0,) * world)
              for k in range(tp)}
    cost_cache: dict[tuple, int] = {}

    def lacking(rank: int, k: int) -> int:
        key = (training.holding(rank), k)
        if key not in cost_cache:
            cost_cache[key] = lacking_elements(training, probes[k], rank)
        return cost_cache[key]

    tp_rank_of, dp_rank_of = [0] * world, [0] * world
    for first in range(0, world, block_size):
        block = range(first, first + block_size)
        room = {k: block_size // tp for k in range(tp)}
        members: dict[int, list[int]] = {k: [] for k in range(tp)}
        assigned: set[int] = set()
        for _, rank, k in sorted((lacking(rank, k), rank, k) for rank in block for k in range(tp)):
            if rank not in assigned and room[k]:
                members[k].append(rank)
                assigned.add(rank)
                room[k] -= 1
        for k, ranks in members.items():
            for index, rank in enumerate(sorted(ranks)):
                tp_rank_of[rank] = k
                dp_rank_of[rank] = first // tp + index
    return tuple(tp_rank_of), tuple(dp_rank_of)


def make_rollout_layout(training: TrainingLayout, engine: str, tp: int,
                        gpus_per_node: int = 8, rollout_ranks: int = 0,
                        moe_block: str = "mlp", expert_parallel: bool = False) -> RolloutLayout:
    """The rollout layout. Colocated (``rollout_ranks`` 0): over the training ranks, with vLLM's
    fixed consecutive grouping, or for the other engines the grouping that overlaps the training
    shards most. Split: over ``rollout_ranks`` ranks after the training ranks, consecutive
    groups (they hold no training shard to overlap). moe_block, expert_parallel: the
    `RolloutLayout` fields."""
    engine_ranks = rollout_ranks or training.world_size
    errors = training.errors() + rollout_errors(training.model, engine, tp, engine_ranks)
    experts = training.model.moe.num_experts
    if expert_parallel and (engine != "vllm" or not experts or experts % engine_ranks):
        errors.append(f"rollout expert parallelism (vLLM's, over all {engine_ranks} engine ranks)"
                      f" needs the vllm engine and model.moe.num_experts={experts} divisible by "
                      f"the engine ranks")
    if errors:
        raise PlanError("cannot reshard: " + "; ".join(errors))
    first_rank = training.world_size if rollout_ranks else 0
    if engine == "megatron" and not rollout_ranks:
        tp_rank_of, dp_rank_of = _planned_grouping(training, engine, tp, gpus_per_node)
        return RolloutLayout(training.model, engine, tp, tp_rank_of, dp_rank_of, first_rank,
                             moe_block, expert_parallel)
    return RolloutLayout.consecutive(training.model, engine, tp, engine_ranks, first_rank,
                                     moe_block, expert_parallel)

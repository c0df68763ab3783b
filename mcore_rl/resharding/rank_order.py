"""The training rank order that makes the weight sync into vLLM cheapest.

vLLM's external launcher forms each rollout TP group from consecutive ranks; that grouping is
fixed. Megatron can lay its TP, DP and PP coordinates over the ranks in any order
(`initialize_model_parallel(order=...)`). With its default order (TP fastest), training TP2 x
PP2 -> rollout TP4 gives rank 1 the second quarter of every tensor to generate with, while it
trains the second half of the first stage: it lacks a quarter of the model. With PP fastest
(ranks 0 and 1 hold the first half of both stages) every rank's rollout quarter lies inside its
training half for its own stage, and it lacks an eighth. So the order is chosen from the two
layouts: the permutation of (tp, dp, pp) whose plan's busiest receiver receives least,
Megatron's default on ties.

A training TP group exchanges activations every layer, so an order is only eligible when it
keeps every training TP group inside one node.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import permutations

import numpy as np

from mcore_rl.config.model import ModelConfig

from .layouts import DEFAULT_ORDER, TrainingLayout
from .grouping import make_rollout_layout
from .plan import lower_bound_received


@dataclass(frozen=True)
class OrderChoice:
    """A training rank order and the weight-sync bytes per rank it implies."""

    order: tuple[str, ...]
    """Fastest-varying dimension first."""

    received: np.ndarray
    """Bytes each rank receives per sync (the plan's lower bound, which it reaches)."""


def tp_groups_within_nodes(training: TrainingLayout, ranks_per_node: int) -> bool:
    """Whether every training TP group lies inside one node (ranks placed node by node)."""
    for pp_rank in range(training.pp):
        for dp_rank in range(training.dp):
            nodes = {training.rank_of(tp_rank, pp_rank, dp_rank) // ranks_per_node
                     for tp_rank in range(training.tp)}
            if len(nodes) > 1:
                return False
    return True


def order_choices(model: ModelConfig, tp: int, pp: int, dp: int, rollout_tp: int,
                  ranks_per_node: int, element_size: int = 2,
                  ep: int = 1, etp: int | None = None,
                  rollout_expert_parallel: bool = False) -> list[OrderChoice]:
    """Every eligible order with its per-rank bytes into vLLM's layout, the default first.
    Dimensions of size 1 keep their default place (where they stand changes nothing). ep:
    expert-parallel size (EP ranks follow the DP coordinate wherever DP stands); etp: expert
    tensor-parallel size (None: TP); rollout_expert_parallel: vLLM's expert parallelism."""
    sizes = {"tp": tp, "pp": pp, "dp": dp}
    movable = [name for name in DEFAULT_ORDER if sizes[name] > 1]
    choices = []
    for arrangement in permutations(movable):
        placed = iter(arrangement)
        order = tuple(next(placed) if sizes[name] > 1 else name for name in DEFAULT_ORDER)
        training = TrainingLayout(model, tp, pp, dp, order, ep, etp)
        if order != DEFAULT_ORDER and not tp_groups_within_nodes(training, ranks_per_node):
            continue
        rollout = make_rollout_layout(training, "vllm", rollout_tp,
                                      expert_parallel=rollout_expert_parallel)
        choices.append(OrderChoice(order, lower_bound_received(training, rollout,
                                                               element_size)))
    return choices


def choose_training_order(model: ModelConfig, tp: int, pp: int, dp: int, rollout_tp: int,
                          ranks_per_node: int, ep: int = 1,
                          etp: int | None = None,
                          rollout_expert_parallel: bool = False) -> tuple[str, ...]:
    """The eligible order whose busiest rank receives the fewest sync bytes (the first listed,
    Megatron's default, on ties: another order is taken only for a real gain)."""
    choices = order_choices(model, tp, pp, dp, rollout_tp, ranks_per_node, ep=ep, etp=etp,
                            rollout_expert_parallel=rollout_expert_parallel)
    return min(choices, key=lambda choice: int(choice.received.max())).order

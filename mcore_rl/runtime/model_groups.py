"""Process groups for a second model with its own tensor and pipeline parallel sizes.

Megatron's global parallel state describes the trained model's layout. A frozen model that
needs another layout over the same ranks (a teacher larger than the student) gets its groups as
an explicit `ProcessGroupCollection`, which Megatron-Core's GPTModel and pipeline schedules take
instead of the global state (Megatron-LM's inference/shards.py and NeMo-RL build theirs the
same way). Every rank creates every group, in the same order (torch.distributed's rule).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist


@dataclass
class ModelGroups:
    """One model's process groups on this rank, and where the rank sits in them."""

    collection: object
    """megatron.core.process_groups_config.ProcessGroupCollection: tp, pp, cp, dp, dp_cp, mp,
    embd, pos_embd (what GPTModel and the schedules ask for)."""

    tp_size: int
    pp_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    """This rank's replica of the model (which copy of the model its rows are scored by)."""

    ep_size: int = 1
    ep_rank: int = 0
    """Which of a Mixture-of-Experts model's expert blocks the rank holds."""

    edp_rank: int = 0
    """Which copy of its experts the rank holds."""

    @property
    def model_parallel(self):
        """The ranks that hold one copy of the model together (TP x PP)."""
        return self.collection.mp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def last_stage_rank(self) -> int:
        """The global rank of this pipeline's last stage."""
        return dist.get_process_group_ranks(self.collection.pp)[-1]


def build_model_groups(tp_size: int, pp_size: int, timeout_minutes: float,
                       ep_size: int = 1) -> ModelGroups:
    """Groups for a model at TP `tp_size` x PP `pp_size` over the current world, ranks ordered
    as Megatron's default (TP fastest, then DP, then PP), and a Mixture-of-Experts model's
    expert groups: its experts split over `ep_size` consecutive data-parallel ranks, each
    expert over the TP ranks (Megatron's tp-ep-dp-pp grid). Collective: every rank calls it."""
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.process_groups_config import ProcessGroupCollection

    world = dist.get_world_size()
    if world % (tp_size * pp_size):
        raise ValueError(f"TP {tp_size} x PP {pp_size} does not divide the {world} ranks")
    dp_size = world // (tp_size * pp_size)
    grid = HyperCommGrid([tp_size, 1, dp_size, pp_size], ["tp", "cp", "dp", "pp"])
    options = {"timeout": datetime.timedelta(minutes=timeout_minutes)}
    collection = ProcessGroupCollection()
    collection.tp = grid.create_pg("tp", **options)
    collection.cp = grid.create_pg("cp", **options)
    collection.pp = grid.create_pg("pp", **options)
    collection.dp = grid.create_pg("dp", **options)
    collection.dp_cp = grid.create_pg(["dp", "cp"], **options)
    collection.tp_cp = grid.create_pg(["tp", "cp"], **options)
    collection.mp = grid.create_pg(["tp", "pp"], **options)
    pipelines = grid.get_rank_enum("pp")
    collection.embd, _ = dist.new_subgroups_by_enumeration(
        [sorted({ranks[0], ranks[-1]}) for ranks in pipelines], **options)
    collection.pos_embd, _ = dist.new_subgroups_by_enumeration(
        [[ranks[0]] for ranks in pipelines], **options)
    collection.tp_dp_cp = grid.create_pg(["tp", "cp", "dp"], **options)
    experts = HyperCommGrid([tp_size, ep_size, dp_size // ep_size, pp_size],
                            ["tp", "ep", "dp", "pp"])
    collection.ep = experts.create_pg("ep", **options)
    collection.expt_tp = experts.create_pg("tp", **options)
    collection.tp_ep = experts.create_pg(["tp", "ep"], **options)
    collection.expt_dp = experts.create_pg("dp", **options)
    return ModelGroups(collection, tp_size, pp_size, dist.get_rank(collection.tp),
                       dist.get_rank(collection.pp), dist.get_rank(collection.dp), ep_size,
                       dist.get_rank(collection.ep), dist.get_rank(collection.expt_dp))

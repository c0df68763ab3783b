"""This rank in one model's layout: the layout, the rank's coordinates, the model's groups.

Why one record, carried
-----------------------
Every part that cuts, moves or computes over a model's shards needs the same three facts: the
model's `ParallelLayout`, where this rank sits in it, and the process groups of its dimensions.
They are built once (the trained models' at start-up, `Runtime.training`; a teacher's when the
teacher is built) and passed to whoever needs them: the model stage carries its own
(`models.model_rank_of`), the trainer, checkpointer, resharder and rollout receive it. Nothing
asks Megatron's global state "where am I" again; the state is created and read back once in
runtime/layout.py, and a second model in another layout (a teacher larger than the student)
gets groups of its own here, as a `ProcessGroupCollection` (Megatron-Core's explicit
alternative to its global state, which GPTModel and the schedules take).

A record without groups (`groups=None`) is a rank of a layout with no live world: conversion
and planning cut shards for every rank of a layout from one process.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

from .layout import ParallelLayout, RankPosition

GROUP_NAMES = {"tp": "tp", "pp": "pp", "dp": "dp", "cp": "cp", "mp": "mp", "ep": "ep",
               "edp": "expt_dp"}
"""Short group names -> `ProcessGroupCollection` fields: tensor, pipeline, data, context,
model (TP x PP), expert and expert-data parallel. "shard" (the ranks that train on one data
shard, TP x CP x PP) is `ModelRank.shard_group`."""


@dataclass(frozen=True)
class ModelRank:
    """Rank ``rank`` of a model laid out as ``layout``, with the model's process groups."""

    layout: ParallelLayout
    rank: int
    """This rank's index in the layout's world (in split placement: in its side's world)."""

    groups: object | None = None
    """megatron.core.process_groups_config.ProcessGroupCollection of the model's dimensions
    (None: no live world)."""

    shard_group: object | None = None
    """The ranks that train on this rank's data shard (TP x CP x PP): the model-parallel group
    when CP is 1, a group of its own otherwise."""

    position: RankPosition = field(init=False)
    """This rank's coordinates in the layout's dense and expert grids."""

    def __post_init__(self):
        object.__setattr__(self, "position", self.layout.position(self.rank))

    @classmethod
    def alone(cls) -> "ModelRank":
        """The only rank of a one-rank layout (a model read or written whole)."""
        return cls(ParallelLayout(1, 1, 1), 0)

    def group(self, name: str):
        """The process group ``name`` ("shard" or one of `GROUP_NAMES`) of this rank."""
        if self.groups is None:
            raise RuntimeError("this layout has no live process groups (a planning record)")
        if name == "shard":
            return self.shard_group if self.shard_group is not None else self.groups.mp
        return getattr(self.groups, GROUP_NAMES[name])

    tp_size = property(lambda self: self.layout.tp)
    pp_size = property(lambda self: self.layout.pp)
    dp_size = property(lambda self: self.layout.dp)
    cp_size = property(lambda self: self.layout.cp)
    ep_size = property(lambda self: self.layout.ep)
    etp_size = property(lambda self: self.layout.expert_tp)
    tp_rank = property(lambda self: self.position.tp_rank)
    pp_rank = property(lambda self: self.position.pp_rank)
    dp_rank = property(lambda self: self.position.dp_rank)
    """Which data shard (rows of a batch) the rank trains on; CP peers share it."""
    cp_rank = property(lambda self: self.position.cp_rank)
    ep_rank = property(lambda self: self.position.ep_rank)
    etp_rank = property(lambda self: self.position.etp_rank)
    edp_rank = property(lambda self: self.position.edp_rank)

    @property
    def replica_rank(self) -> int:
        """Which copy of the model's weights the rank holds (its rank among the data x context
        parallel ranks, numbered as Megatron's DP x CP group)."""
        return self.layout.replica_rank(self.position)

    @property
    def last_stage_rank(self) -> int:
        """Rank (in the layout's world) of the last stage of this rank's pipeline."""
        return self.layout.rank_of(self.tp_rank, self.pp_size - 1, self.dp_rank, self.cp_rank)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def build_model_rank(layout: ParallelLayout, timeout_minutes: float) -> ModelRank:
    """This rank in ``layout`` over the current world, with groups of its own (Megatron-Core's
    `HyperCommGrid`, numbered as Megatron's `RankGenerator`: the dense grid and the expert grid
    in the layout's order). Collective: every rank calls it, with the same layout."""
    import torch.distributed as dist
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.process_groups_config import ProcessGroupCollection

    if layout.world_size != dist.get_world_size():
        raise ValueError(f"a layout of {layout.world_size} ranks over a world of "
                         f"{dist.get_world_size()}")
    options = {"timeout": datetime.timedelta(minutes=timeout_minutes)}
    dense = _grid(HyperCommGrid, layout, {"tp": layout.tp, "cp": layout.cp, "dp": layout.dp,
                                          "pp": layout.pp})
    experts = _grid(HyperCommGrid, layout, {"tp": layout.expert_tp, "ep": layout.ep,
                                            "dp": layout.expert_dp, "pp": layout.pp})
    collection = ProcessGroupCollection()
    for name, dims in (("tp", "tp"), ("cp", "cp"), ("pp", "pp"), ("dp", "dp"),
                       ("dp_cp", ["dp", "cp"]), ("tp_cp", ["tp", "cp"]), ("mp", ["tp", "pp"]),
                       ("tp_dp_cp", ["tp", "cp", "dp"])):
        setattr(collection, name, dense.create_pg(dims, **options))
    for name, dims in (("ep", "ep"), ("expt_tp", "tp"), ("tp_ep", ["tp", "ep"]),
                       ("expt_dp", "dp")):
        setattr(collection, name, experts.create_pg(dims, **options))
    pipelines = dense.get_rank_enum("pp")
    collection.embd, _ = dist.new_subgroups_by_enumeration(
        [sorted({ranks[0], ranks[-1]}) for ranks in pipelines], **options)
    collection.pos_embd, _ = dist.new_subgroups_by_enumeration(
        [[ranks[0]] for ranks in pipelines], **options)
    shard = dense.create_pg(["tp", "cp", "pp"], **options) if layout.cp > 1 else None
    return ModelRank(layout, dist.get_rank(), collection, shard)


def _grid(grid_class, layout: ParallelLayout, sizes: dict[str, int]):
    """A HyperCommGrid over ``sizes`` in the layout's order (fastest first); dimensions the
    order leaves out have size 1 and go last."""
    names = [name for name in layout.order.split("-") if name in sizes]
    names += [name for name in sizes if name not in names]
    return grid_class([sizes[name] for name in names], names)

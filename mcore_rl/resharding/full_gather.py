"""The full-gather weight sync that verl, slime and NeMo-RL's colocated path use: the baseline.

For each parameter, the ranks of the pipeline stage that owns it all-gather their TP shards into
the full tensor (an expert's tensor: the ranks of the owning stage whose expert-parallel rank
holds it, and each other rank of the stage receives it whole from its EP group), the full tensor
is broadcast along each pipeline group, and every rank slices what its engine needs. Every rank
thus receives about the whole model. It lives here so the benchmark can time it against our plan
in the same process and the dry-run planner can count its bytes; nothing in the training loop
uses it.
"""

from __future__ import annotations

from typing import Iterator, Mapping

import math
import torch
import torch.distributed as dist

from mcore_rl.param_layout import sharding

from .layouts import RolloutLayout, TrainingLayout
from .plan import ParamPlan, Transfer
from .shards import split_dim


def _owner_stage(training: TrainingLayout, source: str) -> int:
    """The pipeline stage holding ``source``: where its gather starts."""
    return sharding.to_local_name(source, training.model, training.pp)[0]


def _owner_ep_rank(training: TrainingLayout, source: str) -> int | None:
    """The expert-parallel rank holding expert tensor ``source`` (None for other tensors, which
    every data-parallel rank holds): it decides who all-gathers it and who receives it whole."""
    expert = sharding.expert_of(source)
    if expert is None:
        return None
    return expert // sharding.experts_per_rank(training.model, training.ep)


def _gathered_runs(training: TrainingLayout, owner: int, dp_rank: int, tp_rank: int,
                   full_rows: int, replicated: bool, owner_ep: int | None) -> list[Transfer]:
    """How rank (tp_rank, owner, dp_rank) gets the full tensor on the owning stage: the other
    TP ranks' shards (TP all-gather), nothing for a replicated tensor; for an expert, the other
    expert-TP ranks' shards if its EP rank holds it, else the whole tensor from the holder at
    its expert-TP and expert-DP coordinates (EP all-gather)."""
    dst = training.rank_of(tp_rank, owner, dp_rank)
    if owner_ep is not None:
        return _expert_gathered_runs(training, dst, full_rows, owner_ep)
    if replicated:
        return []
    shard_rows = full_rows // training.tp
    return [Transfer(training.rank_of(other, owner, dp_rank), dst, 0, 0, shard_rows)
            for other in range(training.tp) if other != tp_rank]


def _expert_gathered_runs(training: TrainingLayout, dst: int, full_rows: int,
                          owner_ep: int) -> list[Transfer]:
    grid = training.grid
    at = grid.position(dst)
    if at.ep_rank != owner_ep:
        holder = grid.expert_rank(at.pp_rank, owner_ep, at.etp_rank, at.edp_rank)
        return [Transfer(holder, dst, 0, 0, full_rows)]
    shard_rows = full_rows // grid.expert_tp
    return [Transfer(grid.expert_rank(at.pp_rank, owner_ep, other, at.edp_rank), dst, 0, 0,
                     shard_rows) for other in range(grid.expert_tp) if other != at.etp_rank]


def _full_gather_runs(training: TrainingLayout, owner: int, full_rows: int,
                      replicated: bool, owner_ep: int | None) -> tuple[Transfer, ...]:
    """Messages of one parameter owned by stage ``owner`` (and, for an expert, EP rank
    ``owner_ep``): every rank of that stage gathers the full tensor (`_gathered_runs`), then it
    is chain-broadcast through the other stages of each pipeline group."""
    chain = [(owner + step) % training.pp for step in range(training.pp)]
    runs = []
    for dp_rank in range(training.dp):
        for tp_rank in range(training.tp):
            runs += _gathered_runs(training, owner, dp_rank, tp_rank, full_rows, replicated,
                                   owner_ep)
            runs += [Transfer(training.rank_of(tp_rank, sender, dp_rank),
                              training.rank_of(tp_rank, receiver, dp_rank), 0, 0, full_rows)
                     for sender, receiver in zip(chain, chain[1:])]
    return tuple(runs)


def full_gather_transfers(training: TrainingLayout) -> list[ParamPlan]:
    """The messages of the full-gather sync, per parameter, for byte accounting: a ring
    all-gather within the owning stage's TP groups (each rank receives the other TP ranks'
    shards); for an expert, every rank of that stage whose EP rank lacks it receiving the full
    tensor from its EP group (EP all-gather); then a chain broadcast of the full tensor through
    the other stages of each pipeline group. Parameters with one geometry share one tuple of
    messages (what keeps `traffic_of` fast). Offsets are not meaningful."""
    plans, cache = [], {}
    for source, shape in sharding.canonical_param_shapes(training.model).items():
        owner = _owner_stage(training, source)
        replicated = sharding.shard_kind(source) is sharding.ShardKind.REPLICATED
        owner_ep = _owner_ep_rank(training, source)
        dim = split_dim(source)
        key = (owner, shape, replicated, owner_ep)
        if key not in cache:
            cache[key] = _full_gather_runs(training, owner, shape[dim], replicated, owner_ep)
        plans.append(ParamPlan(source, shape, dim, cache[key], ()))
    return plans


class FullGatherSync:
    """Executes the full-gather sync with torch.distributed collectives (benchmark baseline;
    without expert parallelism)."""

    def __init__(self, training: TrainingLayout, rollout: RolloutLayout):
        if training.ep > 1:
            raise ValueError("FullGatherSync runs the dense full gather only: expert "
                             f"parallelism (training ep={training.ep}) is not supported; "
                             "full_gather_transfers counts its bytes")
        self.training, self.rollout = training, rollout
        self.rank = dist.get_rank()
        self.tp_rank, self.pp_rank, self.dp_rank = training.coordinates(self.rank)
        self.tp_group = self.pp_group = None
        self.pp_ranks: list[int] = []
        for pp_rank in range(training.pp):  # every rank creates every group, in one order
            for dp_rank in range(training.dp):
                ranks = [training.rank_of(tp, pp_rank, dp_rank) for tp in range(training.tp)]
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    self.tp_group = group
        for dp_rank in range(training.dp):
            for tp_rank in range(training.tp):
                ranks = [training.rank_of(tp_rank, pp, dp_rank) for pp in range(training.pp)]
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    self.pp_group, self.pp_ranks = group, ranks

    def sync(self, local_tensors: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (engine name, rollout shard) like `Resharder.sync`."""
        model, training = self.training.model, self.training
        held = training.held(self.rank)
        wanted = self.rollout.wanted(self.rank)
        device = next(iter(local_tensors.values())).device
        dtype = next(iter(local_tensors.values())).dtype
        for source, shape in sharding.canonical_param_shapes(model).items():
            owner = _owner_stage(training, source)
            full = torch.empty(shape, dtype=dtype, device=device)
            if self.pp_rank == owner:
                mine = local_tensors[held[source].name].detach()
                if sharding.shard_kind(source) is sharding.ShardKind.REPLICATED:
                    full.copy_(mine)
                else:
                    shards = [torch.empty_like(mine) for _ in range(training.tp)]
                    dist.all_gather(shards, mine.contiguous(), group=self.tp_group)
                    full.copy_(sharding.merge_from_tp(source, shards, model, training.tp))
            if training.pp > 1:
                dist.broadcast(full, src=self.pp_ranks[owner], group=self.pp_group)
            yield wanted[source].name, wanted[source].cut(full)
            del full


def full_gather_peak_bytes(training: TrainingLayout, element_size: int) -> int:
    """Extra memory of the full-gather sync: the largest full tensor plus its gathered shards."""
    largest = max(math.prod(shape)
                  for shape in sharding.canonical_param_shapes(training.model).values())
    return 2 * largest * element_size

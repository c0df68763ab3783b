"""The trained models' groups: Megatron's global parallel state, created and read back here only.

The actor, critic and reference share one layout, which Megatron-Core keeps as global state
(`initialize_model_parallel`): its optimizer, DDP and schedules read it. This module creates that
state from the job's `ParallelLayout`, checks once that Megatron placed this rank where the
layout's pure rule says (every part that cuts shards relies on the rule), and returns the
`ModelRank` the rest of the job carries. After that nothing reads the global state for a rank's
place or groups.
"""

from __future__ import annotations

import torch.distributed as dist

from .layout import ParallelLayout
from .model_rank import ModelRank


def initialize_training_groups(layout: ParallelLayout, timeout_minutes: float) -> ModelRank:
    """Create the trained models' groups as Megatron's parallel state (collective) and return
    this rank in them, checked against Megatron's read-back."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp, expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
        distributed_timeout_minutes=timeout_minutes, order=layout.order)
    shard = _new_shard_group(layout, timeout_minutes) if layout.cp > 1 else None
    place = ModelRank(layout, dist.get_rank(), ProcessGroupCollection.use_mpu_process_groups(),
                      shard)
    _check_read_back(place)
    return place


def _check_read_back(place: ModelRank) -> None:
    """Raise if Megatron's coordinates of this rank differ from the layout's rule."""
    from megatron.core import parallel_state as ps

    megatron = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                ps.get_data_parallel_rank(), ps.get_context_parallel_rank(),
                ps.get_data_parallel_rank(with_context_parallel=True),
                ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank(),
                ps.get_expert_data_parallel_rank(), ps.get_pipeline_model_parallel_last_rank())
    ours = (place.tp_rank, place.pp_rank, place.dp_rank, place.cp_rank, place.replica_rank,
            place.ep_rank, place.etp_rank, place.edp_rank, place.last_stage_rank)
    if megatron != ours:
        names = ("tp", "pp", "dp", "cp", "dp x cp", "ep", "etp", "edp", "last stage")
        raise RuntimeError(f"rank {place.rank}: Megatron placed it at "
                           f"{dict(zip(names, megatron))}, the layout {place.layout} at "
                           f"{dict(zip(names, ours))}")


def _new_shard_group(layout: ParallelLayout, timeout_minutes: float):
    """The group of the ranks that train on this rank's data shard, TP x CP x PP (collective:
    every rank creates every shard's group, in the same order; Megatron has none spanning
    TP x CP x PP)."""
    import datetime

    mine = None
    dp_rank = layout.position(dist.get_rank()).dp_rank
    for shard in range(layout.dp):
        ranks = sorted(layout.rank_of(tp, pp, shard, cp) for tp in range(layout.tp)
                       for pp in range(layout.pp) for cp in range(layout.cp))
        group = dist.new_group(ranks, timeout=datetime.timedelta(minutes=timeout_minutes))
        if shard == dp_rank:
            mine = group
    return mine


def destroy_training_groups() -> None:
    """Tear down Megatron's parallel state when it exists."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()

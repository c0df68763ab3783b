"""The layout rule (runtime/layout.py) and the rank record the job carries (runtime/model_rank.py)
against Megatron-Core's own rank groups: `RankGenerator` is what initialize_model_parallel builds
every group from, so a rank's coordinate along a dimension must be its index in that dimension's
group, in the dense grid (TP x CP x DP x PP) and in the expert grid (ETP x EP x EDP x PP).

Pure: no world is started. Every spawned world of the suite also checks its ranks' records
against Megatron's read-back once at start-up (runtime/training_groups.py)."""

from __future__ import annotations

import pytest

from mcore_rl.runtime.layout import ParallelLayout
from mcore_rl.runtime.model_rank import ModelRank

# (tp, pp, dp, cp, ep, etp, Megatron order): expert grids equal to the dense one (ETP = TP) and
# cutting across it (ETP1 at TP2 or TP4, ETP2 at TP1), context parallelism before and after
# the data-parallel dimension, in Megatron's default order and others.
GRIDS = [(2, 1, 4, 1, 2, None, "tp-ep-dp-pp"), (2, 1, 2, 1, 2, 1, "tp-ep-dp-pp"),
         (4, 2, 2, 1, 8, 1, "tp-ep-dp-pp"), (1, 2, 4, 1, 2, 2, "tp-ep-dp-pp"),
         (2, 2, 2, 1, 4, 1, "pp-tp-ep-dp"), (2, 2, 4, 1, 2, 1, "ep-dp-tp-pp"),
         (2, 1, 2, 2, 1, None, "tp-cp-ep-dp-pp"), (1, 2, 2, 2, 2, 1, "tp-cp-ep-dp-pp"),
         (2, 2, 2, 2, 2, None, "tp-cp-ep-dp-pp"), (1, 1, 2, 4, 2, 1, "tp-ep-dp-cp-pp")]


def _generators(layout: ParallelLayout):
    from megatron.core.parallel_state import RankGenerator

    dense = RankGenerator(tp=layout.tp, ep=1, dp=layout.dp, pp=layout.pp, cp=layout.cp,
                          order=layout.order)
    expert = RankGenerator(tp=layout.expert_tp, ep=layout.ep, dp=layout.expert_dp, pp=layout.pp,
                           cp=1, order=layout.order)
    return dense, expert


@pytest.mark.parametrize("tp, pp, dp, cp, ep, etp, order", GRIDS)
def test_positions_are_megatrons_rank_groups(tp, pp, dp, cp, ep, etp, order):
    """Each rank's coordinates are its indices in Megatron's groups of both grids, and the
    inverse rules give the rank back."""
    layout = ParallelLayout(tp, pp, dp, cp=cp, ep=ep, etp=etp, order=order)
    assert not layout.errors()
    dense, expert = _generators(layout)
    checks = [(dense, "tp", "tp_rank"), (dense, "dp", "dp_rank"), (dense, "pp", "pp_rank"),
              (dense, "cp", "cp_rank"), (expert, "tp", "etp_rank"), (expert, "ep", "ep_rank"),
              (expert, "dp", "edp_rank")]
    for generator, dimension, field in checks:
        for group in generator.get_ranks(dimension):
            for index, rank in enumerate(group):
                assert getattr(layout.position(rank), field) == index, (dimension, rank)
    for rank in range(layout.world_size):
        at = layout.position(rank)
        assert layout.expert_rank(at.pp_rank, at.ep_rank, at.etp_rank, at.edp_rank) == rank
        assert layout.rank_of(at.tp_rank, at.pp_rank, at.dp_rank, at.cp_rank) == rank


@pytest.mark.parametrize("tp, pp, dp, cp, ep, etp, order", GRIDS)
def test_a_rank_record_derives_what_megatron_groups_say(tp, pp, dp, cp, ep, etp, order):
    """`ModelRank`: the replica rank is the index in Megatron's data x context parallel group
    (the weights' copies the gradients are averaged over), the last stage is the last rank of
    the pipeline group, and the sizes are the layout's."""
    layout = ParallelLayout(tp, pp, dp, cp=cp, ep=ep, etp=etp, order=order)
    dense, _ = _generators(layout)
    replicas = {rank: index for group in dense.get_ranks("dp-cp")
                for index, rank in enumerate(group)}
    last_stage = {rank: group[-1] for group in dense.get_ranks("pp") for rank in group}
    for rank in range(layout.world_size):
        here = ModelRank(layout, rank)
        assert here.replica_rank == replicas[rank], rank
        assert here.last_stage_rank == last_stage[rank], rank
        assert here.is_last_stage == (rank == last_stage[rank])
        assert (here.tp_size, here.pp_size, here.dp_size, here.cp_size, here.ep_size,
                here.etp_size) == (tp, pp, dp, cp, ep, etp or tp)


def test_a_record_without_a_world_has_no_groups():
    """Conversion and planning cut shards for ranks of a layout with no live world: asking
    such a record for a group is an error that says so."""
    with pytest.raises(RuntimeError, match="no live process groups"):
        ModelRank(ParallelLayout(2, 1, 1), 1).group("tp")


def test_an_expert_grid_that_does_not_fit_the_ranks_is_refused():
    assert ParallelLayout(2, 1, 1, ep=4, etp=1).errors() == [
        "parallel.expert_model_parallel_size=4 x expert_tensor_parallel_size=1 must divide "
        "the 2 ranks of a pipeline stage (tensor x context x data parallel)"]

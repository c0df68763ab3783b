"""The rollout layout answers which engine instance a rank is, as vLLM groups ranks, and agrees
with the config's count of instances (checked in-process, no communication)."""

from __future__ import annotations

import dataclasses

import pytest

from mcore_rl.config import JobConfig
from mcore_rl.config.placement import PlacementConfig
from mcore_rl.resharding import RolloutLayout, TrainingLayout, make_rollout_layout

from test_resharding_plan import MODEL


def test_consecutive_instances_over_the_ranks_after_the_trainers():
    """Split placement: 4 rollout ranks (job ranks 2..5) at rollout TP2 form instances {2, 3}
    and {4, 5}; prompts are pooled per instance."""
    layout = make_rollout_layout(TrainingLayout(MODEL, 2, 1, 1), "vllm", 2, rollout_ranks=4)
    assert layout == RolloutLayout.consecutive(MODEL, "vllm", 2, 4, first_rank=2)
    assert layout.split and layout.instances == 2
    assert [layout.instance_of(rank) for rank in layout.ranks] == [0, 0, 1, 1]
    assert [layout.instance_ranks(i) for i in range(2)] == [[2, 3], [4, 5]]
    assert [layout.is_leader(rank) for rank in layout.ranks] == [True, False, True, False]
    assert [layout.job_rank(rank) for rank in range(4)] == [2, 3, 4, 5]
    assert [layout.engine_rank(rank) for rank in layout.ranks] == [0, 1, 2, 3]
    assert [layout.prompt_shard_key(rank, data_shard=9) for rank in layout.ranks] == [0, 0, 1, 1]


def test_colocated_ranks_pool_prompts_by_their_own_data_shard():
    layout = make_rollout_layout(TrainingLayout(MODEL, 2, 1, 2), "vllm", 2)
    assert not layout.split and layout.instances == 2
    assert [layout.instance_of(rank) for rank in layout.ranks] == [0, 0, 1, 1]
    assert layout.prompt_shard_key(3, data_shard=1) == 1


@pytest.mark.parametrize("rollout_ranks, rollout_tp", [(0, 1), (0, 2), (0, 4), (2, 1), (2, 2)])
def test_the_layout_counts_the_instances_the_config_counts(rollout_ranks, rollout_tp):
    world = 4 + rollout_ranks
    config = JobConfig()
    config = dataclasses.replace(
        config, placement=PlacementConfig(rollout_ranks=rollout_ranks),
        rollout=dataclasses.replace(config.rollout, rollout_tp=rollout_tp))
    training = TrainingLayout(MODEL, 1, 1, config.placement.trainer_ranks(world))
    layout = make_rollout_layout(training, "vllm", rollout_tp, rollout_ranks=rollout_ranks)
    assert layout.instances == config.engine_instances(world)

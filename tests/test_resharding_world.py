"""The resharder in real gloo worlds of 4 and 8 processes: every delivered tensor equals the
reference layouts bitwise for both delivery forms, the plan is identical on every rank, bad input
fails on every rank before any byte moves, and with a real Megatron TP2xPP2 model a second sync
after an optimizer step delivers the new weights."""

import pytest
import torch

from resharding_worker import run_checks, run_megatron_sync
from test_resharding_plan import MODEL
from world import run_world

SMALL_BUCKET = 1 << 14  # forces many buckets, so overlap and bucket boundaries are exercised

WORLD_4 = [
    ((2, 2, 1), "vllm", 2, SMALL_BUCKET),
    ((2, 2, 1), "vllm", 4, SMALL_BUCKET),
    ((1, 4, 1), "vllm", 2, SMALL_BUCKET),
    ((2, 2, 1), "megatron", 4, 1 << 30),
    ((1, 2, 2), "megatron", 2, SMALL_BUCKET),
    ((2, 2, 1), "full", 1, SMALL_BUCKET),
]
WORLD_8 = [
    ((2, 2, 2), "vllm", 4, SMALL_BUCKET),
    ((4, 2, 1), "vllm", 2, SMALL_BUCKET),
    ((4, 2, 1), "megatron", 2, SMALL_BUCKET),
]


def assert_all_delivered(results: dict, cases: list) -> None:
    for training_dims, engine, rollout_tp, _ in cases:
        per_rank = results[f"{training_dims}->{engine}{rollout_tp}"]
        assert all(found["wrong"] == [] for found in per_rank), per_rank
        assert len({found["digest"] for found in per_rank}) == 1
        assert all(found["count"] > 0 for found in per_rank)


def test_world_of_4(tmp_path):
    out = tmp_path / "results.pt"
    run_world(4, run_checks, MODEL, WORLD_4, str(out), True)
    results = torch.load(out)
    assert_all_delivered(results, WORLD_4)
    assert results["(2, 2, 1)->vllm4"][0]["buckets"] > 3
    for message in results["bad_input"]:
        assert message.startswith("resharding refused, nothing was sent: rank 1: parameter "
                                  "'decoder.layers.0.mlp.linear_fc2.weight'"), message
    assert all(found["wrong"] == [] for found in results["tied after bad input"])


def test_world_of_8(tmp_path):
    out = tmp_path / "results.pt"
    run_world(8, run_checks, MODEL, WORLD_8, str(out), False)
    assert_all_delivered(torch.load(out), WORLD_8)


@pytest.mark.slow
def test_second_sync_after_an_optimizer_step_delivers_the_new_weights(tmp_path):
    out = tmp_path / "results.pt"
    run_world(4, run_megatron_sync, MODEL, str(out))
    for found in torch.load(out):
        assert found["before"] == [] and found["after"] == []
        # every weight has a gradient under the policy loss, so every shard must change
        assert found["changed"] == found["total"] > 0

"""The resharder in real gloo worlds of 4 and 8 processes: every delivered tensor equals the
reference layouts bitwise for both delivery forms, the plan is identical on every rank, bad input
fails on every rank before any byte moves, and with a real Megatron TP2xPP2 model a second sync
after an optimizer step delivers the new weights. In split placement (trainer ranks apart from
rollout ranks, two default worlds and a bridge) the same holds across the bridge."""

import pytest
import torch

from resharding_worker import run_checks, run_megatron_sync, run_split_checks
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


SPLIT_4 = [  # two trainer ranks, then two rollout ranks
    ((2, 1, 1), "vllm", 2, SMALL_BUCKET),  # TP2 trainers -> one TP2 engine
    ((1, 1, 2), "vllm", 1, SMALL_BUCKET),  # DP2 trainers -> two engine replicas
    ((1, 2, 1), "megatron", 2, 1 << 30),
]


def test_split_placement_world_of_4(tmp_path):
    out = str(tmp_path / "results.pt")
    run_world(4, run_split_checks, MODEL, 2, SPLIT_4, out)
    found = [torch.load(f"{out}.{rank}") for rank in range(4)]
    assert [(f["side"], f["side_rank"], f["side_size"]) for f in found] == [
        ("trainer", 0, 2), ("trainer", 1, 2), ("rollout", 0, 2), ("rollout", 1, 2)]
    assert [f["side_sum"] for f in found] == [1.0, 1.0, 5.0, 5.0]  # 0+1 and 2+3: separate worlds
    for training_dims, engine, rollout_tp, _ in SPLIT_4:
        per_rank = [f[f"{training_dims}->{engine}{rollout_tp}"] for f in found]
        assert all(rank["wrong"] == [] for rank in per_rank), per_rank
        assert [rank["count"] > 0 for rank in per_rank] == [False, False, True, True]
        # Each rollout rank receives exactly its whole shard (the lower bound), the trainers none.
        assert [rank["received"] for rank in per_rank] == [rank["lower_bound"]
                                                           for rank in per_rank]
        assert per_rank[0]["sent"] > 0 and per_rank[1]["sent"] > 0
    for f in found:
        assert f["bad_input"].startswith("resharding refused, nothing was sent: rank 1: "), f


def test_delta_syncs_deliver_what_a_full_sync_does_bitwise():
    """Ten delta syncs (verified, anchor every 4) after optimizer-like updates, in bf16 and
    fp32: every shard equals the reference layout bit for bit; in bf16 the delta syncs receive a
    fraction of the lower bound, in fp32 (every element moved) no more than a full sync, and
    the anchors (syncs 0, 4, 8) all of it; a bit flipped in a
    rollout rank's copy is caught by the checksums, named, and repaired by a whole resend; a
    resharder made afresh (a restart) starts whole."""
    from resharding_worker import run_delta_checks

    per_rank = run_world(4, run_delta_checks, MODEL, 10)
    for dtype in ("torch.bfloat16", "torch.float32"):
        found = [rank[dtype] for rank in per_rank]
        for rank in found:
            assert all(sync["wrong"] == [] for sync in rank["syncs"]), rank
            assert rank["flipped"]["wrong"] == [] and rank["restarted"]["wrong"] == []
            assert rank["resent_whole"] == 1 and rank["held"] > 0
            received = [sync["received"] for sync in rank["syncs"]]
            if rank["lower_bound"] == 0:
                continue
            for step, got in enumerate(received):
                if step % 4 == 0:
                    assert got >= rank["lower_bound"], (dtype, received)
                elif dtype == "torch.bfloat16":  # most elements keep their bf16 value
                    assert got < 0.5 * rank["lower_bound"], (dtype, received)
                else:  # every fp32 element moved: each message goes whole, nothing more
                    assert got == received[0], (dtype, received)
            assert rank["restarted"]["received"] >= rank["lower_bound"]
        errors = [message for rank in found for message in rank["errors"]]
        assert len(errors) == 4, errors  # every rank logs the same gathered error
        assert "delta sync checksum mismatch, resending every shard whole: rank 1: " in errors[0]
        assert " rows " in errors[0] and "differs from the trainer's" in errors[0]

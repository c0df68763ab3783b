"""Parking a trained model in host memory while the engine generates (actor.offload /
critic.offload): everything it holds on the device is freed, and a model parked and restored
before every step trains bitwise like one that never moved (DP2, with and without Megatron's
distributed optimizer, whose fp32 shards are views into the parameter buffers)."""

import pytest
import torch

from world import run_world


@pytest.fixture(scope="module")
def ranks():
    from offload_worker import compare_parked_and_unmoved

    return run_world(2, compare_parked_and_unmoved)


@pytest.mark.parametrize("distributed_optimizer", [True, False])
def test_parked_model_trains_bitwise_like_unmoved(ranks, distributed_optimizer):
    from offload_worker import STEPS

    for rank, results in enumerate(ranks):
        moved, still = results[distributed_optimizer, True], results[distributed_optimizer, False]
        assert len(moved["parameters"]) == len(still["parameters"])
        for a, b in zip(moved["parameters"], still["parameters"]):
            assert torch.equal(a, b), f"rank {rank}: a parameter differs after parking"
        assert len(moved["optimizer_state"]) == len(still["optimizer_state"]) > 0
        for a, b in zip(moved["optimizer_state"], still["optimizer_state"]):
            assert torch.equal(a, b), f"rank {rank}: Adam state differs after parking"
        assert moved["left_on_device"] == [0] * STEPS
        # Parameters and their fp32 gradient buffer at least; after the first step also the two
        # Adam moments (of this rank's shard with the distributed optimizer).
        parameter_bytes = moved["parameter_bytes"]
        moments = parameter_bytes * (1 if distributed_optimizer else 2)
        assert moved["freed"][0] >= 2 * parameter_bytes
        assert moved["freed"][1] >= 2 * parameter_bytes + moments
        assert moved["freed"][2] == moved["freed"][1]

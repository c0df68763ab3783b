"""Device discipline, checked on CPU: no tensor reaches a model, an op or a collective on
another device than its own (tests/device_discipline.py tells host tensors from accelerator
tensors on a CPU-only machine).

A world of 4 (TP1 x PP2 x DP2) runs the paths where host batches meet device models: PPO with a
critic and a KL loss to a reference (actor, critic and reference forward passes, GAE with
whitening over DP, the KL statistics), token-budget micro-batches through the pipeline, DP
sequence-length balancing (point-to-point rows), the Megatron engine's generation, an
evaluation, and a resharder sync (batched point-to-point weights).
"""

import math

import pytest
import torch

from world import run_world

OVERRIDES = ["rollout.engine=megatron", "algorithm.estimator=gae", "algorithm.use_kl_loss=true",
             "parallel.pipeline_model_parallel_size=2", "trainer.balance_data_parallel=true",
             "actor.max_tokens_per_micro_batch=96", "critic.micro_batch_size=16",
             "trainer.eval_every=0", "trainer.save_every=0"]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    from mcore_rl.data import write_toy_tokenizer
    from rl_worker import steps_under_device_discipline

    folder = tmp_path_factory.mktemp("discipline")
    overrides = OVERRIDES + [f"data.tokenizer={write_toy_tokenizer(str(folder / 'tok'))}",
                             f"runtime.output_dir={folder / 'run'}"]
    run_world(4, steps_under_device_discipline, str(folder / "result.pt"), overrides)
    return torch.load(folder / "result.pt")


def test_rl_steps_keep_tensors_on_their_devices(result):
    """Reaching here means no DeviceMismatch was raised; the steps also trained."""
    for metrics in result["history"]:
        for name in ("actor/loss", "critic/loss", "actor/kl_to_reference", "reward/mean"):
            assert math.isfinite(metrics[name]), name
        assert metrics["training/update_skipped"] == 0
    assert result["history"][1]["actor/kl_to_reference"] > 0  # the actor moved
    assert 0 <= result["evaluation"]["eval/accuracy"] <= 1
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in result["synced"]


def test_harness_catches_host_tensors_at_a_model_and_a_collective(result):
    model_call, collective = result["caught"]
    assert model_call.startswith("aten.embedding.default: host tensors [(1, 3) torch.int64] "
                                 "meet accelerator tensors")
    assert collective.startswith("torch.distributed.all_reduce was handed host tensors")

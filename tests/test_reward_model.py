"""The reward model role against transformers: a tiny random LlamaForSequenceClassification
(num_labels=1) loaded into a Megatron scalar-head model at TP2 scores right-padded prompt +
response rows exactly as transformers scores each row on its own (the last token's logit)."""

import json

import pytest
import torch
import transformers

from hf_models import CASES, SMALL, reference_batch
from world import run_world


def save_classifier(folder) -> transformers.PreTrainedModel:
    _, _, extra = CASES["qwen2"]
    config = transformers.Qwen2Config(**SMALL, **extra, num_labels=1, pad_token_id=0,
                                      architectures=["Qwen2ForSequenceClassification"])
    torch.manual_seed(3)
    model = transformers.AutoModelForSequenceClassification.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_((1.0 if "norm" in name else 0.0) + 0.15 * torch.randn_like(param))
    model.save_pretrained(folder, safe_serialization=True)
    return model


def test_reward_model_matches_transformers_at_tp2(tmp_path):
    from rl_worker import reward_model_scores

    hf_model = save_classifier(tmp_path / "rm")
    run_world(2, reward_model_scores, str(tmp_path / "scores.pt"), str(tmp_path / "rm"), 2)
    scores = torch.load(tmp_path / "scores.pt")
    ids, mask = reference_batch(SMALL["vocab_size"])
    with torch.no_grad():
        expected = [hf_model(input_ids=row[:int(length)].unsqueeze(0)).logits[0, 0]
                    for row, length in zip(ids, mask.sum(1))]
    assert torch.allclose(scores, torch.stack(expected), atol=1e-4), (scores, expected)
    assert torch.stack(expected).std() > 0.1  # the rows really score differently


def test_reward_model_folder_is_checked(tmp_path):
    from mcore_rl.conversion.sequence_classifier import open_sequence_classifier

    save_classifier(tmp_path / "rm")
    config = json.loads((tmp_path / "rm" / "config.json").read_text())
    (tmp_path / "rm" / "config.json").write_text(json.dumps(
        dict(config, architectures=["Qwen2ForCausalLM"])))
    with pytest.raises(ValueError, match="is not a ...ForSequenceClassification"):
        open_sequence_classifier(str(tmp_path / "rm"))


def test_a_reward_models_score_is_a_reward_and_accuracy_stays_the_ground_truth_check(tmp_path):
    """GRPO on the toy copy task, once rewarded by its rule and once by a reward model that
    scores every response 5.0 (its layers add nothing to a constant embedding; the head reads
    5.0 off it): the initial policy's greedy evaluation and first samples are the same in both
    runs, so the reward-model run must report the rule's eval/accuracy and reward/accuracy (read
    off the scores, as before, every answer would be "correct"), its scores as
    eval/rm_score_mean and reward/mean, and no eval/reward_mean."""
    import os

    from rl_worker import evaluate_then_step

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=2, vocab_size=16, num_labels=1,
                                      pad_token_id=0, max_position_embeddings=64, rms_norm_eps=1e-6,
                                      architectures=["LlamaForSequenceClassification"])
    model = transformers.AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.fill_(1.0)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.score.weight.fill_(5.0 / config.hidden_size)
    model.save_pretrained(tmp_path / "rm", safe_serialization=True)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    runs = {}
    for name, extra in (("rule", []), ("rm", [f"reward.model_path={tmp_path / 'rm'}"])):
        run_world(1, evaluate_then_step, str(tmp_path / f"{name}.pt"),
                  [f"runtime.output_dir={tmp_path / name}", "trainer.eval_every=0",
                   "trainer.plots=false", *extra])
        runs[name] = torch.load(tmp_path / f"{name}.pt")
    rule, rm = runs["rule"], runs["rm"]
    assert rm["evaluation"]["eval/rm_score_mean"] == pytest.approx(5.0, rel=1e-5)
    assert rm["step"]["reward/mean"] == pytest.approx(5.0, rel=1e-5)
    assert "eval/reward_mean" not in rm["evaluation"]
    assert rm["evaluation"]["eval/accuracy"] == rule["evaluation"]["eval/accuracy"] < 1
    assert rm["step"]["reward/accuracy"] == rule["step"]["reward/accuracy"] < 1
    assert rm["step"]["response/length_mean"] == rule["step"]["response/length_mean"]

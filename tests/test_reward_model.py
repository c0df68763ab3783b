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


def save_reward_model_for_a_word(folder, word_id: int, vocab_size: int = 16) -> None:
    """A LlamaForSequenceClassification that scores a sequence by the share of its tokens that
    are `word_id`: 0 without the word, rising with its share (to about 5). Every embedding is
    e0, the word's e0 + e1; zero query and key projections make attention average the
    (normalised) embeddings of all positions, which identity value and output projections add
    to the last one; after the final RMSNorm the e1 component grows with the word's share, and
    the head reads it."""
    hidden = 64
    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=96,
                                      vocab_size=vocab_size, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, num_labels=1,
                                      pad_token_id=0, max_position_embeddings=64,
                                      rms_norm_eps=1e-6,
                                      architectures=["LlamaForSequenceClassification"])
    model = transformers.AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.model.embed_tokens.weight[word_id, 1] = 1.0
        attention = model.model.layers[0].self_attn
        for projection in (attention.q_proj, attention.k_proj):
            projection.weight.zero_()
        for projection in (attention.v_proj, attention.o_proj):
            projection.weight.copy_(torch.eye(hidden))
        model.model.layers[0].mlp.down_proj.weight.zero_()
        model.score.weight.zero_()
        model.score.weight[0, 1] = 1.0
    scores = model(input_ids=torch.tensor([[2, 5, 5, 1], [2, 5, word_id, 1],
                                           [2, word_id, word_id, 1]])).logits[:, 0].tolist()
    assert scores[0] == pytest.approx(0.0, abs=1e-6) and 1.0 < scores[1] < scores[2], scores
    model.save_pretrained(folder, safe_serialization=True)


def test_a_run_built_to_hack_its_reward_model_is_warned_of_and_stopped(tmp_path, capfd):
    """The toy copy task ("copy 7" -> "7") rewarded by a reward model that pays for the share
    of the word "is" in the sequence, no KL penalty (the reference only measures): the policy
    learns to say "is", its reward model score rises, and the warning must fire (the KL bound
    set to 1 nat: a random policy that always says "is" is log(16) = 2.8 nats from its
    start). Selected by the copy accuracy, which saying "is" cannot raise, the run keeps its
    start as the best and stops early."""

    from rl_worker import fit

    from mcore_rl.data.toy import TOY_VOCAB

    save_reward_model_for_a_word(tmp_path / "rm", TOY_VOCAB.index("is"))
    out = tmp_path / "run"
    run_world(1, fit, str(tmp_path / "fit.pt"), [
        f"runtime.output_dir={out}", f"reward.model_path={tmp_path / 'rm'}",
        "algorithm.use_kl_loss=true", "algorithm.kl_coef=0", "trainer.total_steps=30",
        "trainer.eval_every=3", "trainer.save_every=0", "trainer.plots=false",
        "trainer.reward_hacking.kl_bound=1.0", "trainer.selection.metric=eval/accuracy",
        "trainer.selection.patience=3", "trainer.selection.min_delta=0.05"])
    result = torch.load(tmp_path / "fit.pt")
    evaluations = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    first, last = evaluations[0], evaluations[-1]
    print("eval rows:", [(row["step"], row["eval/rm_score_mean"], row["eval/accuracy"],
                          row.get("warnings/reward_hacking")) for row in evaluations])
    assert last["eval/rm_score_mean"] > first["eval/rm_score_mean"] + 1.0
    assert last["warnings/kl_exceeded"] == 1.0 and last["warnings/reward_hacking"] == 1.0
    assert "signs of reward hacking: eval/rm_score_mean rose" in capfd.readouterr().out
    best = json.loads((out / "hf" / "best.json").read_text())
    assert best == {"metric": "eval/accuracy", "value": first["eval/accuracy"], "step": 0,
                    "higher_is_better": True}
    assert result["stopped"] and len(result["history"]) == 9  # evaluations 3, 6, 9
    kept = out / "hf" / "best"
    assert (kept / "config.json").is_file() and any(kept.glob("*.safetensors"))


def test_the_reward_models_best_answer_is_read_over_all_ten_digits(tmp_path):
    """The preference report's ceiling of PPO: a reward model that pays for the share of the
    digit 7 gives 7 as its best answer to every question, right exactly where 7 is the
    answer."""
    from mcore_rl.data.toy import write_word_tokenizer
    from mcore_rl.quickstart.preference_report import reward_model_best_answer_accuracy
    from mcore_rl.quickstart.task import VOCABULARY, rl_rows, write_jsonl

    save_reward_model_for_a_word(tmp_path / "rm", VOCABULARY.index("7"), len(VOCABULARY))
    write_word_tokenizer(str(tmp_path / "rm"), VOCABULARY)
    questions = [("max 1 2 3", "3"), ("max 7 2 0", "7"), ("max 9 7 1", "9"), ("max 4 6 5", "6")]
    write_jsonl(str(tmp_path / "val.jsonl"), rl_rows(questions))
    assert reward_model_best_answer_accuracy(str(tmp_path / "rm"), str(tmp_path / "val.jsonl")
                                             ) == 0.25

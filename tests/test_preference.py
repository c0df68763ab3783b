"""Preference jobs: the pair files' rules, and `rm` / `dpo` against slow references written here
on HF transformers with torch's Adam on the same pairs: losses, statistics and weights after two
steps at TP2 x DP2 (reward model, DPO) and PP2 x DP2 (IPO), and the exported reward model
scored by transformers and, through reward.model_path, by Megatron."""

import json

import pytest
import torch
import torch.nn.functional as F

from hf_models import write_tiny_qwen3_moe
from lora_reference import assert_same_adapter, lora_overrides, peft_policy

from mcore_rl.config.preference import DpoConfig, RmConfig
from mcore_rl.data.records import DataError
from mcore_rl.data.toy import write_word_tokenizer
from mcore_rl.preference.data import load_pairs, read_pairs
from mcore_rl.quickstart.task import VOCABULARY

# Prompts and responses of different lengths, so padding, micro-batches and masks matter.
PAIRS = [("max 3 8", "8", "3"), ("max 1 2 7", "7", "1 2"), ("max 5 0", "5 5", "0"),
         ("max 0 9 9", "9", "0 9"), ("max 6 2", "6", "2 2 2"), ("max 4 1", "4", "1"),
         ("max 2 8 3", "8", "3 3"), ("max 7 1 0", "7", "0")]
LR, EPS, STEPS = 1e-2, 1e-5, 2  # eps: see tests/test_sft.py (Adam on near-zero gradients)


def write_rows(path, rows):
    with open(path, "w") as handle:
        for row in rows:
            handle.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


def pair_rows():
    return [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = write_word_tokenizer(str(tmp_path_factory.mktemp("tok")), VOCABULARY)
    return AutoTokenizer.from_pretrained(folder)


# -- the pair files' rules ---------------------------------------------------------------------
def test_bad_rows_name_the_file_line_and_rule(tmp_path):
    good = {"prompt": "max 1 2", "chosen": "2", "rejected": "1"}
    cases = [({"prompt": "max 1 2", "chosen": "2"}, "line 2: no 'rejected' column"),
             ({"prompt": "max 1", "chosen": " ", "rejected": "1"}, "line 2: 'chosen' must be"),
             ({"prompt": "max 1", "chosen": "1", "rejected": [{"role": "assistant"}]},
              "line 2: 'rejected': prompt messages must be dicts with role and content"),
             ("{not json", "line 2: malformed JSON")]
    for index, (bad, expected) in enumerate(cases):
        path = write_rows(tmp_path / f"bad{index}.jsonl", [good, bad])
        with pytest.raises(DataError, match=expected):
            read_pairs(path, RmConfig())
    with pytest.raises(DataError, match="preference file not found"):
        read_pairs(str(tmp_path / "missing.jsonl"), DpoConfig())


def test_parquet_without_rejected_is_refused_before_reading(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "pairs.parquet")
    pq.write_table(pa.table({"prompt": ["max 1 2"], "chosen": ["2"], "worse": ["1"]}), path)
    monkeypatch.setattr(pq.ParquetFile, "iter_batches",
                        lambda *a, **k: pytest.fail("rows were read"))
    with pytest.raises(DataError, match="no 'rejected' column.*set dpo.rejected_key"):
        read_pairs(path, DpoConfig())


def test_identical_and_overlong_pairs_are_counted(tmp_path, tokenizer):
    rows = pair_rows() + [{"prompt": "max 1 1", "chosen": "1", "rejected": "1"}]
    path = write_rows(tmp_path / "pairs.jsonl", rows)
    # "max 1 2 7" + "1 2" + <eos> and "max 0 9 9" + "0 9" + <eos>, "max 6 2" + "2 2 2" + <eos>
    # are 7 tokens, "max 2 8 3" + "3 3" + <eos> too: over 6.
    dropped = load_pairs([path], RmConfig(max_length=6), tokenizer, "auto")
    assert (dropped.num_pairs, dropped.dropped_too_long, dropped.identical) == (4, 4, 1)
    cut = load_pairs([path], RmConfig(max_length=6, overlong="truncate"), tokenizer, "auto")
    assert (cut.num_pairs, cut.truncated, cut.dropped_too_long) == (8, 4, 0)
    vocab = {token: index for index, token in enumerate(VOCABULARY)}
    # pair 1 ("max 1 2 7", "7", "1 2"): rejected cut to 2 of its 3 tokens (no <eos>)
    assert cut.token_ids[3] == [vocab[t] for t in "max 1 2 7 1 2".split()]
    assert cut.token_ids[2] == [vocab[t] for t in "max 1 2 7 7 <eos>".split()]
    assert cut.prompt_lengths[2:4] == [4, 4]


def test_config_rules_name_the_field():
    errors = DpoConfig(train_files=["a.csv"], batch_size=6, micro_batch_size=4, beta=0,
                       loss_type="kto", overlong="wrap").errors(2)
    for expected in ("dpo.train_files: 'a.csv' must end with", "dpo.batch_size=6 must split",
                     "dpo.beta=0 must be > 0", "dpo.loss_type='kto' must be one of",
                     "dpo.overlong='wrap' must be one of"):
        assert any(expected in error for error in errors), (expected, errors)
    assert RmConfig(train_files=["a.jsonl"], reward_l2=-1).errors(1) == [
        "rm.reward_l2=-1 must be >= 0"]


# -- the jobs against transformers ------------------------------------------------------------
def sequences(tokenizer):
    """[(chosen ids, rejected ids, prompt length)] of every pair: prompt + response + <eos>."""
    result = []
    for prompt, chosen, rejected in PAIRS:
        prompt_ids = tokenizer(prompt)["input_ids"]
        result.append(tuple(prompt_ids + tokenizer(response, add_special_tokens=False)[
            "input_ids"] + [tokenizer.eos_token_id] for response in (chosen, rejected))
                      + (len(prompt_ids),))
    return result


def adam_steps(model, loss_of, steps=STEPS):
    """Full-batch Adam steps; the (loss, statistics) before each step."""
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=EPS)
    logged = []
    for _ in range(steps):
        loss, statistics = loss_of(model)
        logged.append((loss.item(), statistics))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return logged


def reward_model_reference(hf_init, tokenizer, margin, l2, lora=False):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(hf_init, num_labels=1,
                                                               torch_dtype=torch.float32)
    with torch.no_grad():
        model.score.weight.zero_()  # the Megatron scalar head starts at zero
    if lora:
        model = peft_policy(model, modules_to_save=["score"])
    pairs = sequences(tokenizer)

    def loss_of(model):
        score = lambda ids: model(torch.tensor([ids])).logits[0, 0]  # noqa: E731
        chosen = torch.stack([score(c) for c, _, _ in pairs])
        rejected = torch.stack([score(r) for _, r, _ in pairs])
        loss = (-F.logsigmoid(chosen - rejected - margin)
                + l2 * (chosen ** 2 + rejected ** 2)).mean()
        return loss, {"accuracy": (chosen > rejected).float().mean().item(),
                      "margin": (chosen - rejected).mean().item()}

    return adam_steps(model, loss_of), loss_of(model)[0].item(), model


def dpo_reference(hf_init, tokenizer, beta, loss_type, smoothing, lora=False):
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(hf_init, torch_dtype=torch.float32)
    if lora:
        policy = peft_policy(policy)
    reference = AutoModelForCausalLM.from_pretrained(hf_init, torch_dtype=torch.float32)
    pairs = sequences(tokenizer)

    def logp(model, ids, prompt_length):
        logprobs = model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
        picked = logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])][prompt_length - 1:]
        return picked.mean() if loss_type == "ipo" else picked.sum()

    with torch.no_grad():
        ref = [(logp(reference, c, n), logp(reference, r, n)) for c, r, n in pairs]

    def loss_of(model):
        chosen = torch.stack([logp(model, c, n) - ref[i][0] for i, (c, _, n) in enumerate(pairs)])
        rejected = torch.stack([logp(model, r, n) - ref[i][1]
                                for i, (_, r, n) in enumerate(pairs)])
        h = chosen - rejected
        if loss_type == "ipo":
            losses = (h - 1 / (2 * beta)) ** 2
        else:
            losses = (-(1 - smoothing) * F.logsigmoid(beta * h)
                      - smoothing * F.logsigmoid(-beta * h))
        return losses.mean(), {"rewards/chosen": (beta * chosen).mean().item(),
                               "rewards/margin": (beta * h).mean().item(),
                               "rewards/accuracy": (h > 0).float().mean().item()}

    return adam_steps(policy, loss_of), loss_of(policy)[0].item(), policy


def logged_lines(folder, name="metrics.jsonl"):
    return [json.loads(line) for line in open(folder / name)]


def assert_same_weights(exported_folder, reference_model, auto_class, initial=None):
    trained = auto_class.from_pretrained(exported_folder, torch_dtype=torch.float32)
    expected = reference_model.state_dict()
    for name, tensor in trained.state_dict().items():
        assert torch.allclose(tensor, expected[name], atol=1e-4), name


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The three jobs and the reward model's Megatron scores, in one 4-rank world."""
    from preference_worker import run_jobs
    from world import free_port, run_world

    from mcore_rl.quickstart.tiny_model import write_tiny_llama

    root = tmp_path_factory.mktemp("preference")
    hf_init = write_tiny_llama(str(root / "hf_init"), VOCABULARY, seed=3)
    moe_init = write_tiny_qwen3_moe(str(root / "moe_init"), VOCABULARY)
    pairs = write_rows(root / "pairs.jsonl", pair_rows())

    def job(section, layout, *extra, init=hf_init):
        return [f"init.hf_path={init}", f"{section}.train_files=[{pairs}]",
                f"{section}.val_files=[{pairs}]", f"{section}.epochs={STEPS}",
                f"{section}.batch_size={len(PAIRS)}", f"{section}.micro_batch_size=2",
                f"{section}.optimizer.lr={LR}", f"{section}.optimizer.adam_eps={EPS}",
                f"{section}.optimizer.clip_grad=0", f"{section}.max_length=32", layout, *extra]

    tp2, pp2 = "parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2"
    jobs = [("rm", job("rm", tp2, "rm.margin=0.5", "rm.reward_l2=0.05",
                       f"runtime.output_dir={root / 'rm'}"), free_port()),
            ("dpo", job("dpo", tp2, "dpo.beta=0.5", "dpo.label_smoothing=0.1",
                        f"runtime.output_dir={root / 'dpo'}"), free_port()),
            ("dpo", job("dpo", pp2, "dpo.loss_type=ipo", "dpo.beta=0.5",
                        f"runtime.output_dir={root / 'ipo'}"), free_port()),
            ("dpo", job("dpo", tp2, "dpo.beta=0.5", "dpo.label_smoothing=0.1",
                        *lora_overrides("dpo"), f"runtime.output_dir={root / 'lora_dpo'}"),
             free_port()),
            ("rm", job("rm", tp2, "rm.margin=0.5", "rm.reward_l2=0.05", *lora_overrides("rm"),
                       f"runtime.output_dir={root / 'lora_rm'}"), free_port()),
            ("rm", job("rm", "parallel.expert_model_parallel_size=2", "rm.margin=0.5",
                       "rm.reward_l2=0.05", f"runtime.output_dir={root / 'moe_rm'}",
                       init=moe_init), free_port()),
            ("dpo", job("dpo", "parallel.expert_model_parallel_size=2", "dpo.beta=0.5",
                        "dpo.label_smoothing=0.1", f"runtime.output_dir={root / 'moe_dpo'}",
                        init=moe_init), free_port())]
    run_world(4, run_jobs, jobs, (str(root / "scores.pt"), str(root / "rm" / "hf"), free_port()))
    return root, hf_init, moe_init


def assert_reward_model_matches(folder, hf_init, tokenizer, lora=False) -> None:
    """The RM job in `folder` against transformers' classifier trained by torch Adam (lora:
    peft's adapters and a whole score head; the job exports them merged)."""
    from transformers import AutoModelForSequenceClassification

    steps, final_loss, reference = reward_model_reference(hf_init, tokenizer, 0.5, 0.05, lora)
    if lora:
        reference = reference.merge_and_unload()
    logged = logged_lines(folder)
    assert [line["rm/loss"] for line in logged] == pytest.approx([s[0] for s in steps], rel=1e-5)
    assert logged[1]["rm/margin"] == pytest.approx(steps[1][1]["margin"], rel=1e-4)
    assert logged[1]["rm/accuracy"] == steps[1][1]["accuracy"]
    evaluated = logged_lines(folder, "eval.jsonl")[-1]
    assert evaluated["rm/val_loss"] == pytest.approx(final_loss, rel=1e-5)
    assert_same_weights(folder / "hf", reference, AutoModelForSequenceClassification)


def test_reward_model_with_lora_matches_peft(trained, tokenizer):
    """rm.lora at TP2 x DP2: adapters and a whole scalar head, against peft's (modules_to_save
    the score head) trained by torch Adam."""
    root, hf_init, _ = trained
    assert_reward_model_matches(root / "lora_rm", hf_init, tokenizer, lora=True)


def test_moe_reward_model_with_experts_split_matches_transformers(trained, tokenizer):
    """A Qwen3-MoE reward model (scalar head) with its experts split over 2 of the 4 ranks."""
    root, _, moe_init = trained
    assert_reward_model_matches(root / "moe_rm", moe_init, tokenizer)


def test_reward_model_matches_transformers_at_tp2_dp2(trained, tokenizer):
    from transformers import AutoModelForSequenceClassification

    from preference_worker import scoring_rows

    root, hf_init, _ = trained
    assert_reward_model_matches(root / "rm", hf_init, tokenizer)

    # The export, scored by transformers and by Megatron through reward.model_path.
    exported = AutoModelForSequenceClassification.from_pretrained(root / "rm" / "hf",
                                                                  torch_dtype=torch.float32)
    ids, mask = scoring_rows()
    with torch.no_grad():
        expected = exported(input_ids=ids, attention_mask=mask).logits[:, 0]
    megatron = torch.load(root / "scores.pt")
    assert torch.allclose(megatron, expected, atol=1e-4), (megatron, expected)
    assert expected.std() > 0.05  # the rows really score differently


@pytest.mark.parametrize("name, loss_type, smoothing", [("dpo", "sigmoid", 0.1),
                                                        ("ipo", "ipo", 0.0),
                                                        ("moe_dpo", "sigmoid", 0.1),
                                                        ("lora_dpo", "sigmoid", 0.1)])
def test_dpo_matches_transformers(trained, tokenizer, name, loss_type, smoothing):
    """dpo: TP2 x DP2, cDPO label smoothing; ipo: PP2 x DP2, length-normalised log-ratios;
    moe_dpo: a Qwen3-MoE with its experts split over 2 of the 4 data-parallel ranks (EP2);
    lora_dpo: adapters (dpo.lora) at TP2 x DP2 against peft's, the reference being the policy
    with its adapters off."""
    from transformers import AutoModelForCausalLM

    root, hf_init, moe_init = trained
    init = moe_init if name.startswith("moe") else hf_init
    steps, final_loss, policy = dpo_reference(init, tokenizer, 0.5, loss_type, smoothing,
                                              lora=name.startswith("lora"))
    logged = logged_lines(root / name)
    assert [line["dpo/loss"] for line in logged] == pytest.approx([s[0] for s in steps],
                                                                  rel=1e-5)
    for statistic in ("rewards/chosen", "rewards/margin", "rewards/accuracy"):
        assert logged[1][f"dpo/{statistic}"] == pytest.approx(steps[1][1][statistic], rel=1e-4,
                                                              abs=1e-6)
    assert logged[1]["dpo/rewards/margin"] > 0.01  # the step moved the policy
    evaluated = logged_lines(root / name, "eval.jsonl")[-1]
    assert evaluated["dpo/val_loss"] == pytest.approx(final_loss, rel=1e-5)
    if name.startswith("lora"):
        assert_same_adapter(root / name / "hf" / "adapter", policy, hf_init)
        policy = policy.merge_and_unload()
    assert_same_weights(root / name / "hf", policy, AutoModelForCausalLM)

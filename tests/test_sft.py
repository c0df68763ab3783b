"""Supervised fine-tuning: the demonstration files' rules, the loss mask, and `mcore-rl sft` at
TP2 x DP2 (a Llama) and with experts split over 2 ranks (a Qwen3-MoE) against HF transformers
trained with torch's Adam on the same examples."""

import json
import os
import subprocess
import sys

import pytest
import torch

from hf_models import write_tiny_qwen3_moe
from lora_reference import assert_same_adapter, lora_overrides, peft_policy
from world import run_world

from mcore_rl.config.sft import SftConfig
from mcore_rl.data.records import DataError
from mcore_rl.data.toy import write_word_tokenizer
from mcore_rl.quickstart.task import VOCABULARY
from mcore_rl.sft.data import (epoch_order, load_demonstrations, make_batch, rank_rows,
                               read_demonstrations)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Different prompt and response lengths, so padding and the loss mask matter.
DEMONSTRATIONS = [("max 3 8", "8"), ("max 1 2 7 4", "7"), ("max 5", "5 5"), ("max 0 9 9", "9"),
                  ("max 6 2 1 1 3", "6 6"), ("max 4 4", "4"), ("max 2 8 3", "8 8 8"),
                  ("max 7 1 0", "7")]


def write_rows(path, rows):
    with open(path, "w") as handle:
        for row in rows:
            handle.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = write_word_tokenizer(str(tmp_path_factory.mktemp("tok")), VOCABULARY)
    return AutoTokenizer.from_pretrained(folder)


def test_bad_rows_name_the_file_line_and_rule(tmp_path):
    good = {"prompt": "max 1 2", "response": "2"}
    cases = [({"prompt": "max 1 2"}, "line 2: no 'response' column"),
             ({"prompt": "max 1", "response": "  "}, "line 2: 'response' must be non-empty"),
             ({"prompt": "", "response": "1"}, "line 2: prompt is empty"),
             ("{not json", "line 2: malformed JSON")]
    for index, (bad, expected) in enumerate(cases):
        path = write_rows(tmp_path / f"bad{index}.jsonl", [good, bad])
        with pytest.raises(DataError, match=expected):
            read_demonstrations(path, "prompt", "response")
    with pytest.raises(DataError, match="demonstration file not found"):
        read_demonstrations(str(tmp_path / "missing.jsonl"), "prompt", "response")


def test_parquet_without_the_response_column_is_refused_before_reading(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "demos.parquet")
    pq.write_table(pa.table({"prompt": ["max 1 2"], "answer": ["2"]}), path)
    with pytest.raises(DataError, match="no 'response' column.*set sft.response_key"):
        read_demonstrations(path, "prompt", "response")
    assert read_demonstrations(path, "prompt", "answer")[0].response == "2"


def test_loss_mask_covers_the_response_and_eos_only(tokenizer, tmp_path):
    path = write_rows(tmp_path / "demos.jsonl",
                      [{"prompt": p, "response": r} for p, r in DEMONSTRATIONS])
    examples = load_demonstrations([path], SftConfig(max_length=6), tokenizer, "auto")
    # Over 6 tokens: "max 1 2 7 4" "7" <eos>, "max 6 2 1 1 3" "6 6" <eos>, "max 2 8 3" "8 8 8"
    # <eos>.
    assert examples.dropped_too_long == 3 and len(examples.token_ids) == 5
    vocab = {token: index for index, token in enumerate(VOCABULARY)}
    batch = make_batch(examples, [0, 1], pad_id=vocab["<pad>"])
    expected_ids = [[vocab[t] for t in "max 3 8 8 <eos>".split()],
                    [vocab[t] for t in "max 5 5 5 <eos>".split()]]
    assert batch["input_ids"].tolist() == expected_ids
    assert batch["loss_mask"].tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 1, 1]]
    assert batch["attention_mask"].tolist() == [[1] * 5, [1] * 5]
    padded = make_batch(examples, [0, 2], pad_id=vocab["<pad>"])  # "max 0 9 9" "9" <eos>
    assert padded["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [1] * 6]
    assert padded["loss_mask"].tolist() == [[0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1]]
    assert padded["input_ids"][0, 5] == vocab["<pad>"]


def test_epoch_order_and_rank_rows():
    order = epoch_order(10, seed=3, epoch=0)
    assert sorted(order) == list(range(10)) and order != epoch_order(10, seed=3, epoch=1)
    shares = [rank_rows(order, 1, 4, rank, 2) for rank in range(2)]
    assert shares[0] + shares[1] == order[4:8] and len(shares[0]) == 2


def test_config_rules_name_the_field():
    errors = SftConfig(train_files=["a.csv"], batch_size=6, micro_batch_size=4).errors(2)
    assert any("sft.train_files: 'a.csv' must end with" in e for e in errors)
    assert any("sft.batch_size=6 must split into 2 data-parallel ranks" in e for e in errors)
    assert SftConfig(train_files=["a.jsonl"], batch_size=8, micro_batch_size=4).errors(2) == []


def hf_reference(hf_folder, tokenizer, lr, eps, steps, lora=False):
    """HF transformers + torch Adam on all demonstrations per step: token-mean NLL of the
    response tokens and <eos>. Returns the losses before each step, the gradient norms and the
    final weights (lora: of peft's adapters on the model, `lora_reference.peft_policy`; then
    the model is returned, not its weights)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_folder, torch_dtype=torch.float32)
    if lora:
        model = peft_policy(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=eps)
    losses, grad_norms = [], []
    for _ in range(steps):
        loss = response_nll(model, tokenizer, DEMONSTRATIONS)
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        grad_norms.append(torch.sqrt(sum(p.grad.double().square().sum()
                                         for p in model.parameters()
                                         if p.grad is not None)).item())
        optimizer.step()
    return losses, grad_norms, model if lora else model.state_dict()


def response_nll(model, tokenizer, demonstrations) -> torch.Tensor:
    """Token-mean negative log-likelihood of the responses and <eos> under an HF model."""
    total, count = 0.0, 0
    for prompt, response in demonstrations:
        prompt_ids = tokenizer(prompt)["input_ids"]
        ids = prompt_ids + tokenizer(response)["input_ids"] + [tokenizer.eos_token_id]
        logprobs = model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
        picked = logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        total = total - picked[len(prompt_ids) - 1:].sum()
        count += len(ids) - len(prompt_ids)
    return total / count


def _convert_to_hf(checkpoint: str, folder: str) -> None:
    from mcore_rl.conversion.mcore_to_hf import convert_mcore_to_hf
    from mcore_rl.runtime import start_process_group

    start_process_group(timeout_minutes=3)
    convert_mcore_to_hf(checkpoint, folder)


def exported_to_hf(checkpoint, folder):
    """`checkpoint` converted to HF (what `mcore-rl convert mcore-to-hf` runs; the command
    itself is tested in test_megatron_versions), loaded back with transformers."""
    from transformers import AutoModelForCausalLM

    run_world(1, _convert_to_hf, str(checkpoint), str(folder))
    return AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)


def run(*arguments, ranks, port):
    env = dict(os.environ, PYTHON=sys.executable, NPROC_PER_NODE=str(ranks),
               MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    return subprocess.run([os.path.join(REPO, "scripts", "torchrun.sh"), *arguments], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)


def test_sft_command_matches_hf_with_torch_adam_at_tp2_dp2(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    from mcore_rl.quickstart.tiny_model import write_tiny_llama

    hf_init = write_tiny_llama(str(tmp_path / "hf_init"), VOCABULARY, seed=3)
    demos = write_rows(tmp_path / "demos.jsonl",
                       [{"prompt": p, "response": r} for p, r in DEMONSTRATIONS])
    # Adam divides each element's gradient by its own scale: with a tiny eps, an element whose
    # gradient is ~0 turns the summation-order noise of TP/DP reductions into a full +-lr step.
    # eps = 1e-5 keeps such elements linear in their gradient (differences stay below 1e-4);
    # the others move by ~lr, so a wrong or missing step is off by ~1e-2.
    lr, eps, steps = 1e-2, 1e-5, 2
    out = tmp_path / "sft"
    arguments = ["sft", f"init.hf_path={hf_init}", f"sft.train_files=[{demos}]",
                 f"sft.epochs={steps}", f"sft.batch_size={len(DEMONSTRATIONS)}",
                 "sft.micro_batch_size=2", f"sft.optimizer.lr={lr}", f"sft.optimizer.adam_eps={eps}",
                 "sft.optimizer.clip_grad=0",
                 "sft.max_length=32", f"runtime.output_dir={out}"]
    done = run(*arguments, "parallel.tensor_model_parallel_size=2", ranks=4, port=29571)
    assert done.returncode == 0, done.stderr[-3000:]

    losses, grad_norms, reference = hf_reference(hf_init, tokenizer, lr, eps, steps)
    logged = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [line["step"] for line in logged] == [1, 2]
    assert [line["sft/loss"] for line in logged] == pytest.approx(losses, rel=1e-5)
    # Every TP shard counted once (Megatron must know which parameters are TP-split).
    assert [line["sft/grad_norm"] for line in logged] == pytest.approx(grad_norms, rel=1e-4)
    assert losses[1] < losses[0] - 0.1

    trained = exported_to_hf(out / "model", tmp_path / "hf_out")
    initial = AutoModelForCausalLM.from_pretrained(hf_init, torch_dtype=torch.float32)
    initial_weights = initial.state_dict()
    for name, tensor in trained.state_dict().items():
        assert torch.allclose(tensor, reference[name], atol=1e-4), name
        if name.endswith("q_proj.weight"):
            assert (tensor - initial_weights[name]).abs().max() > 1e-3, "no update happened"

    again = subprocess.run([sys.executable, "-m", "mcore_rl", *arguments], cwd=REPO,
                           capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, MASTER_PORT="29572"))
    assert again.returncode == 2, again.stderr[-2000:]
    assert f"runtime.output_dir={out} already holds an SFT run" in again.stderr


def test_sft_with_lora_matches_peft_at_pp2(tmp_path, tokenizer):
    """`mcore-rl sft` with sft.lora at PP2 against peft's adapters trained by torch Adam: the
    losses, gradient norms, the exported adapter, and the merged weights it saves."""
    from mcore_rl.quickstart.tiny_model import write_tiny_llama

    hf_init = write_tiny_llama(str(tmp_path / "hf_init"), VOCABULARY, seed=3)
    demos = write_rows(tmp_path / "demos.jsonl",
                       [{"prompt": p, "response": r} for p, r in DEMONSTRATIONS])
    lr, eps, steps = 1e-2, 1e-5, 2
    out = tmp_path / "sft"
    done = run("sft", f"init.hf_path={hf_init}", f"sft.train_files=[{demos}]",
               f"sft.epochs={steps}", f"sft.batch_size={len(DEMONSTRATIONS)}",
               "sft.micro_batch_size=2", f"sft.optimizer.lr={lr}",
               f"sft.optimizer.adam_eps={eps}", "sft.optimizer.clip_grad=0", "sft.max_length=32",
               *lora_overrides("sft"), "parallel.pipeline_model_parallel_size=2",
               f"runtime.output_dir={out}", ranks=2, port=29574)
    assert done.returncode == 0, done.stderr[-3000:]
    losses, grad_norms, policy = hf_reference(hf_init, tokenizer, lr, eps, steps, lora=True)
    logged = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [line["sft/loss"] for line in logged] == pytest.approx(losses, rel=1e-5)
    assert [line["sft/grad_norm"] for line in logged] == pytest.approx(grad_norms, rel=1e-4)
    assert losses[1] < losses[0]
    assert_same_adapter(out / "adapter", policy, hf_init)
    merged = policy.merge_and_unload().state_dict()
    for name, tensor in exported_to_hf(out / "model", tmp_path / "hf_out").state_dict().items():
        assert torch.allclose(tensor, merged[name], atol=1e-5), name


def hf_loss(hf_folder, state_dict, tokenizer, demonstrations) -> float:
    """`response_nll` of transformers' model with `state_dict`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_folder, torch_dtype=torch.float32)
    model.load_state_dict(state_dict)
    with torch.no_grad():
        return response_nll(model, tokenizer, demonstrations).item()


def test_sft_of_a_moe_model_with_experts_split_matches_hf(tmp_path, tokenizer):
    """`mcore-rl sft` of a Qwen3-MoE at EP2 (each rank holds 2 of the 4 experts, tokens travel
    all-to-all) equals transformers' own MoE trained with torch Adam: losses, gradient norms
    and the exported weights."""
    hf_init = write_tiny_qwen3_moe(str(tmp_path / "hf_init"), VOCABULARY)
    demos = write_rows(tmp_path / "demos.jsonl",
                       [{"prompt": p, "response": r} for p, r in DEMONSTRATIONS])
    # 5 held-out examples: 3 on one rank, 2 on the other, yet both run 2 micro-batches.
    held_out = write_rows(tmp_path / "held_out.jsonl",
                          [{"prompt": p, "response": r} for p, r in DEMONSTRATIONS[:5]])
    lr, eps, steps = 1e-2, 1e-5, 2  # as above
    out = tmp_path / "sft"
    done = run("sft", f"init.hf_path={hf_init}", f"sft.train_files=[{demos}]",
               f"sft.val_files=[{held_out}]", f"sft.epochs={steps}",
               f"sft.batch_size={len(DEMONSTRATIONS)}", "sft.micro_batch_size=2",
               f"sft.optimizer.lr={lr}", f"sft.optimizer.adam_eps={eps}",
               "sft.optimizer.clip_grad=0", "sft.max_length=32", f"runtime.output_dir={out}",
               "parallel.expert_model_parallel_size=2", ranks=2, port=29573)
    assert done.returncode == 0, done.stderr[-3000:]

    losses, grad_norms, reference = hf_reference(hf_init, tokenizer, lr, eps, steps)
    logged = [json.loads(line) for line in open(out / "metrics.jsonl")]
    trained = [line for line in logged if "sft/loss" in line]
    assert [line["sft/loss"] for line in trained] == pytest.approx(losses, rel=1e-5)
    assert [line["sft/grad_norm"] for line in trained] == pytest.approx(grad_norms, rel=1e-4)
    final_val_loss = [json.loads(line) for line in open(out / "eval.jsonl")][-1]["sft/val_loss"]
    assert final_val_loss == pytest.approx(
        hf_loss(hf_init, reference, tokenizer, DEMONSTRATIONS[:5]), rel=1e-5)
    weights = exported_to_hf(out / "model", tmp_path / "hf_out")
    for name, tensor in weights.state_dict().items():
        assert torch.allclose(tensor, reference[name], atol=1e-4), name

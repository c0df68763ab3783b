"""The quickstart directory: what `prepare` writes before the jobs run, and the `report` that
reads their results back afterwards.

    <dir>/data/          sft_train.jsonl (24 demonstrations), sft_val.jsonl, rl_train.jsonl,
                         rl_val.jsonl (200 held-out questions, never trained on),
                         pairs_train.jsonl, pairs_val.jsonl (preference pairs, the answer
                         over each wrong digit: of the training questions but the last 100,
                         and of the held-out ones), rlhf_train.jsonl
                         and rlhf_dev.jsonl (RL rows of the pairs' questions and of those last
                         100: what scripts/preference_pipeline.sh trains PPO on and selects by)
    <dir>/hf_init/       the tiny random Llama and its tokenizer (HF)
    <dir>/mcore_init/    the same converted to a Megatron checkpoint
    <dir>/sft/           the SFT run; sft/model is its weights checkpoint
    <dir>/grpo/          the GRPO run: metrics, eval.jsonl, tensorboard/, plots/, checkpoints/,
                         hf/step_N (the trained actor as an HF folder)
"""

from __future__ import annotations

from pathlib import Path

from .task import VOCABULARY, preference_rows, rl_rows, sft_rows, split_questions, write_jsonl
from .tiny_model import write_tiny_llama

HELD_OUT_QUESTIONS = 200
DEMONSTRATIONS = 24
DEV_QUESTIONS = 100  # the preference pipeline's validation set, for checkpoint selection
SEED = 0


def prepare(directory: str) -> None:
    """Write the data files and the tiny HF model (skipped when already there)."""
    root = Path(directory)
    _prepare_pairs(root / "data")
    if (root / "hf_init").is_dir():
        print(f"prepare: {root / 'hf_init'} exists, keeping it and {root / 'data'}")
        return
    split = split_questions(HELD_OUT_QUESTIONS, DEMONSTRATIONS, SEED)
    data = root / "data"
    write_jsonl(str(data / "sft_train.jsonl"), sft_rows(split["demonstrations"]))
    write_jsonl(str(data / "sft_val.jsonl"), sft_rows(split["held_out"]))
    write_jsonl(str(data / "rl_train.jsonl"), rl_rows(split["train"]))
    write_jsonl(str(data / "rl_val.jsonl"), rl_rows(split["held_out"]))
    write_tiny_llama(str(root / "hf_init"), VOCABULARY, SEED)
    print(f"prepare: {len(split['demonstrations'])} demonstrations, {len(split['train'])} "
          f"training prompts, {len(split['held_out'])} held-out questions in {data}; tiny "
          f"Llama in {root / 'hf_init'}")


def _prepare_pairs(data: Path) -> None:
    """Preference pairs for `mcore-rl rm` / `dpo` (configs/quickstart/rm.yaml, dpo.yaml) and
    the RL rows of SFT -> RM -> PPO (configs/quickstart/ppo_rm.yaml). The last DEV_QUESTIONS
    training questions are left out of both, so that PPO's checkpoint can be selected on
    questions neither the reward model nor the policy was trained on, and the held-out ones
    stay for the final figure."""
    if (data / "rlhf_dev.jsonl").is_file():
        return
    split = split_questions(HELD_OUT_QUESTIONS, DEMONSTRATIONS, SEED)
    train, dev = split["train"][:-DEV_QUESTIONS], split["train"][-DEV_QUESTIONS:]
    write_jsonl(str(data / "pairs_val.jsonl"), preference_rows(split["held_out"]))
    write_jsonl(str(data / "pairs_train.jsonl"), preference_rows(train))
    write_jsonl(str(data / "rlhf_train.jsonl"), rl_rows(train))
    write_jsonl(str(data / "rlhf_dev.jsonl"), rl_rows(dev))


def report(directory: str) -> str:
    """Accuracy before and after RL, the exported model's own accuracy under HF transformers,
    and where everything went."""
    from mcore_rl.observability import load_run

    root = Path(directory)
    grpo = load_run(root / "grpo")
    steps, accuracy = grpo.series("eval/accuracy")
    export = _latest_export(root / "grpo" / "hf")
    lines = [f"held-out accuracy ({HELD_OUT_QUESTIONS} questions never trained on, greedy):",
             f"  after SFT on {DEMONSTRATIONS} demonstrations (RL step {steps[0]}): "
             f"{accuracy[0]:.1%}",
             f"  after GRPO (step {steps[-1]}): {accuracy[-1]:.1%}   "
             f"({100 * (accuracy[-1] - accuracy[0]):+.1f} points)"]
    if export:
        lines.append(f"  the exported HF model under transformers: "
                     f"{hf_accuracy(str(export), str(root / 'data' / 'rl_val.jsonl')):.1%}")
    lines += ["", "where everything went:"]
    places = [("data (jsonl)", root / "data"), ("tiny HF model", root / "hf_init"),
              ("Megatron checkpoint", root / "mcore_init"), ("SFT weights", root / "sft" / "model"),
              ("SFT logs", root / "sft"), ("GRPO logs (metrics.jsonl, eval.jsonl)", root / "grpo"),
              ("TensorBoard", f"tensorboard --logdir {root}"), ("plots", root / "grpo" / "plots"),
              ("GRPO checkpoints", root / "grpo" / "checkpoints"), ("exported HF model", export)]
    lines += [f"  {name:<40} {place}" for name, place in places if place]
    if export:
        lines += ["", "serve the exported model (OpenAI API and POST /generate on 127.0.0.1:8000):",
                  f"  .venv/bin/mcore-rl serve {export} --dtype float32"]
    return "\n".join(lines)


def _latest_export(folder: Path) -> Path | None:
    """The newest hf/step_<N> folder (zero-padded names sort by step), if any."""
    steps = sorted(path for path in folder.glob("step_*") if path.name[5:].isdigit())
    return steps[-1] if steps else None


def hf_accuracy(model_folder: str, prompts_file: str, max_new_tokens: int = 2) -> float:
    """Greedy accuracy of an HF folder on a prompt file, scored by the task's reward, with HF
    transformers alone: the round trip back to HF kept what RL learned."""
    import json

    import torch
    import transformers

    from mcore_rl.evaluation import is_correct
    from mcore_rl.rewards.toy import copy_score

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_folder)
    with open(prompts_file) as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    inputs = tokenizer([row["prompt"] for row in rows], return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens,
                                pad_token_id=tokenizer.pad_token_id)
    responses = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1]:],
                                       skip_special_tokens=True)
    correct = [is_correct(copy_score(row["data_source"], response,
                                     row["reward_model"]["ground_truth"], {}))
               for row, response in zip(rows, responses)]
    return sum(correct) / len(correct)

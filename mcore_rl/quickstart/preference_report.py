"""The last step of scripts/preference_pipeline.sh: what each stage is worth on the held-out
questions, with transformers alone on the HF folders.

Beside the policies' accuracies it reports the reward model's own best answer: for each
held-out question, whether the digit it scores highest is the right one. That is the accuracy
of a policy that maximised the reward model exactly, so it says what PPO can reach on it; a
reward model's pair accuracy does not (a model can rank the right answer above one wrong digit
per pair 97% of the time and still prefer a wrong digit to it on a third of the questions).
"""

from __future__ import annotations

import json
from pathlib import Path

from .files import HELD_OUT_QUESTIONS, hf_accuracy
from .task import DIGITS


def reward_model_best_answer_accuracy(rm_folder: str, prompts_file: str) -> float:
    """Fraction of the file's questions whose highest-scored one-digit answer (digit + <eos>,
    as a policy's complete answer ends) is the ground truth."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(rm_folder)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(rm_folder).eval()
    rows = [json.loads(line) for line in Path(prompts_file).read_text().splitlines() if line]
    right = 0
    with torch.no_grad():
        for row in rows:
            answers = [tokenizer(f"{row['prompt']} {digit}").input_ids
                       + [tokenizer.eos_token_id] for digit in DIGITS]
            scores = [float(model(input_ids=torch.tensor([ids])).logits[0, 0]) for ids in answers]
            right += DIGITS[scores.index(max(scores))] == row["reward_model"]["ground_truth"]
    return right / len(rows)


def preference_report(directory: str) -> str:
    """The pipeline's figures, as lines and as one markdown table row for docs/preference.md."""
    root = Path(directory)
    held_out = str(root / "data" / "rl_val.jsonl")
    rm = [json.loads(line) for line in (root / "rm" / "eval.jsonl").read_text().splitlines()][-1]
    rm_best = reward_model_best_answer_accuracy(str(root / "rm" / "hf"), held_out)
    best = json.loads((root / "ppo" / "hf" / "best.json").read_text())
    last = sorted((root / "ppo" / "hf").glob("step_*"))
    accuracy = {"SFT": hf_accuracy(str(root / "sft" / "hf"), held_out),
                "PPO best": hf_accuracy(str(root / "ppo" / "hf" / "best"), held_out),
                "PPO last": hf_accuracy(str(last[-1]), held_out) if last else None,
                "DPO": hf_accuracy(str(root / "dpo" / "hf"), held_out)}
    percent = lambda value: "-" if value is None else f"{value:.1%}"
    last_name = last[-1].name if last else "no export"
    lines = [f"held-out answer accuracy ({HELD_OUT_QUESTIONS} questions, greedy, transformers):",
             f"  reward model: pair accuracy {rm['rm/val_accuracy']:.1%} (margin "
             f"{rm['rm/val_margin']:.2f}); its own best answer is right on {rm_best:.1%}",
             f"  SFT:                     {percent(accuracy['SFT'])}",
             f"  SFT -> RM -> PPO (best): {percent(accuracy['PPO best'])}   (step {best['step']}, "
             f"{best['metric']} {best['value']:.1%} on data/rlhf_dev.jsonl)",
             f"  SFT -> RM -> PPO (last): {percent(accuracy['PPO last'])}   ({last_name})",
             f"  SFT -> DPO:              {percent(accuracy['DPO'])}",
             "", "| SFT | RM pairs | RM best answer | PPO best (step) | PPO last | DPO |",
             f"| {percent(accuracy['SFT'])} | {rm['rm/val_accuracy']:.1%} | {rm_best:.1%} | "
             f"{percent(accuracy['PPO best'])} ({best['step']}) | "
             f"{percent(accuracy['PPO last'])} | {percent(accuracy['DPO'])} |"]
    return "\n".join(lines)

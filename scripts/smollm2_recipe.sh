#!/usr/bin/env bash
# SmolLM2-135M-Instruct on easy arithmetic, 2 CPU ranks: reasoning-gym generates the task
# (2 terms, 1-2 digits, + and -, no parentheses or negation: data.reasoning_gym.task_kwargs),
# a one-epoch SFT warm-up on 224 generated demonstrations (question -> the number), then 40 GRPO
# steps (configs/grpo_smollm2_reasoning_gym.yaml, same task settings, 8 prompts x 8 samples a
# step, lr 1e-5, no KL term, old log-probs from the engine) with greedy held-out accuracy on 256
# questions before the first step, every 10 steps and after. Figures, and why these settings:
# docs/smollm2_example.md.
#
#   bash scripts/smollm2_recipe.sh [extra mcore-rl train overrides]     # SMOLLM2_DIR moves it
#   bash scripts/smollm2_recipe.sh --sft-only    # stages 1-2 (bench/trl_grpo.py's smollm2-learn)
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
DIR=${SMOLLM2_DIR:-runs/smollm2_recipe}
PY=${PYTHON:-.venv/bin/python}
MODEL=runs/models/smollm2-135m-instruct
TASK='{"basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2,
  "operators": ["+", "-"], "allow_parentheses": false, "allow_negation": false}}'
SYSTEM="Compute the result. Answer with just the number, no words."
started=$SECONDS
phase() { echo; echo "== $1   [$((SECONDS - started)) s]"; }
ranks() { PYTHON=$PY NPROC_PER_NODE=2 scripts/torchrun.sh "$@"; }

phase "1/3 model and demonstrations"
[ -d "$MODEL" ] || $PY -c "from mcore_rl.conversion.gguf_to_hf import gguf_to_hf, \
smollm2_gguf_path; gguf_to_hf(smollm2_gguf_path(), '$MODEL')"
mkdir -p "$DIR"
$PY - "$DIR" "$TASK" "$SYSTEM" <<'PYTHON'
import json, sys
from mcore_rl.config.data import ReasoningGymConfig
from mcore_rl.data.reasoning_gym_source import reasoning_gym_records
from mcore_rl.quickstart.task import write_jsonl

root, task, system = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
source = ReasoningGymConfig(tasks=list(task), task_kwargs=task, system_prompt=system)
# Seed 500000: neither the GRPO prompts (seed 0) nor the held-out questions (seed 1e9).
records = reasoning_gym_records(source, 256, seed=500_000)
rows = [{"prompt": r.prompt, "response": r.ground_truth} for r in records]
write_jsonl(f"{root}/demos_train.jsonl", rows[:224])
write_jsonl(f"{root}/demos_val.jsonl", rows[224:])
PYTHON

phase "2/3 SFT warm-up (1 epoch of 224 demonstrations)"
[ -d "$DIR/sft/model" ] || ranks sft init.hf_path="$MODEL" runtime.output_dir="$DIR/sft" \
  "sft.train_files=[$DIR/demos_train.jsonl]" "sft.val_files=[$DIR/demos_val.jsonl]" \
  sft.max_length=96 sft.epochs=1 sft.batch_size=16 sft.micro_batch_size=8 sft.eval_every=7 \
  sft.optimizer.lr=1e-5 runtime.precision=fp32 trainer.console_every=7

if [ "${1:-}" = "--sft-only" ]; then echo "SFT weights in $DIR/sft/model"; exit 0; fi

phase "3/3 GRPO from the SFT weights"
ranks train --config configs/grpo_smollm2_reasoning_gym.yaml init.hf_path=null \
  init.checkpoint="$DIR/sft/model" runtime.output_dir="$DIR/grpo" \
  "data.reasoning_gym.task_kwargs=$TASK" \
  data.reasoning_gym.val_size=256 rollout.sampling.max_new_tokens=16 \
  rollout.eval_sampling.max_new_tokens=16 rollout.prompts_per_step=8 rollout.old_logprobs=engine \
  actor.micro_batch_size=32 algorithm.use_kl_loss=false \
  trainer.total_steps=40 trainer.eval_every=10 "$@"
echo "smollm2 recipe: $((SECONDS - started)) s"

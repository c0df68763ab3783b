#!/usr/bin/env bash
# SmolLM2-135M-Instruct learns to use a calculator, 2 CPU ranks: reasoning-gym arithmetic it
# cannot do in its head (3-4 terms of 2-3 digits, + and -), a `calculator` tool run in each
# episode's sandbox and called in the hermes format (<tool_call>{"name": "calculator",
# "arguments": {"expression": ...}}</tool_call>), configs/grpo_smollm2_tools.yaml.
#   1. the model and the demonstrated episodes (question -> call -> result -> the number)
#   2. a short SFT warm-up on them (one SFT row per assistant turn)
#   3. GRPO on multi-turn episodes through vLLM; greedy held-out accuracy, tool use, tool errors
#      and turns on 256 questions before the first step, every 10 steps and after
# Figures and why these settings: docs/agents.md ("A real model learns a calculator").
#
#   bash scripts/smollm2_tools_recipe.sh [extra mcore-rl train overrides]
#       (SMOLLM2_TOOLS_DIR moves the demonstrations, the SFT weights and the GRPO run)
#   bash scripts/smollm2_tools_recipe.sh runtime.seed=3 runtime.output_dir=/tmp/tools/grpo_s3
#   bash scripts/smollm2_tools_recipe.sh --sft-only
#   bash scripts/smollm2_tools_recipe.sh --no-tool MODEL   # the same held-out questions answered
#       without the tool, in the plain recipe's setting. MODEL: an HF folder (the instruct model,
#       a GRPO run's export: trainer.export_hf_every=20 -> grpo/hf/step_00000020) or the SFT
#       weights ($SMOLLM2_TOOLS_DIR/sft/model)
# A rerun keeps the demonstrations and the SFT weights it finds.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
DIR=${SMOLLM2_TOOLS_DIR:-runs/smollm2_tools_recipe}
PY=${PYTHON:-.venv/bin/python}
MODEL=runs/models/smollm2-135m-instruct
CONFIG=configs/grpo_smollm2_tools.yaml
DEMONSTRATIONS=32
started=$SECONDS
phase() { echo; echo "== $1   [$((SECONDS - started)) s]"; }
ranks() { PYTHON=$PY NPROC_PER_NODE=2 scripts/torchrun.sh "$@"; }
weights() { if [ -f "$1/config.json" ]; then echo "init.hf_path=$1"; else
  echo "init.hf_path=null init.checkpoint=$1"; fi; }

if [ "${1:-}" = "--no-tool" ]; then
  [ -n "${2:-}" ] || { echo "--no-tool needs a model folder" >&2; exit 2; }
  PLAIN=$($PY -c "from mcore_rl.config import load_config; print(load_config(
'configs/grpo_smollm2_reasoning_gym.yaml').data.reasoning_gym.system_prompt)")
  NAME=$(basename "$(dirname "$2")")_$(basename "$2")
  ranks train --config $CONFIG $(weights "$2") runtime.output_dir="$DIR/no_tool/$NAME" \
    "rollout.multi_turn.tools=[]" "data.reasoning_gym.system_prompt=$PLAIN" \
    trainer.val_only=true "${@:3}"
  echo "no-tool held-out figures: $DIR/no_tool/$NAME/eval.jsonl (step 0)"
  exit 0
fi

phase "1/3 model and demonstrations"
[ -d "$MODEL" ] || $PY -c "from mcore_rl.conversion.gguf_to_hf import gguf_to_hf, \
smollm2_gguf_path; gguf_to_hf(smollm2_gguf_path(), '$MODEL')"
[ -f "$DIR/demos_train.jsonl" ] || $PY -m mcore_rl.quickstart prepare-tools "$DIR" \
  --config $CONFIG --demonstrations $DEMONSTRATIONS

phase "2/3 SFT warm-up ($DEMONSTRATIONS demonstrated episodes, one epoch)"
[ -d "$DIR/sft/model" ] || ranks sft init.hf_path="$MODEL" runtime.output_dir="$DIR/sft" \
  "sft.train_files=[$DIR/demos_train.jsonl]" "sft.val_files=[$DIR/demos_val.jsonl]" \
  sft.max_length=160 sft.epochs=1 sft.batch_size=16 sft.micro_batch_size=8 \
  sft.optimizer.lr=5e-5 runtime.precision=fp32 trainer.console_every=1

if [ "${1:-}" = "--sft-only" ]; then echo "SFT weights in $DIR/sft/model"; exit 0; fi

phase "3/3 GRPO on multi-turn episodes with the calculator"
ranks train --config $CONFIG init.hf_path=null init.checkpoint="$DIR/sft/model" \
  runtime.output_dir="$DIR/grpo" "$@"
echo "smollm2 tools recipe: $((SECONDS - started)) s; held-out figures: eval.jsonl of the run"

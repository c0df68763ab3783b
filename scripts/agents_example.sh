#!/usr/bin/env bash
# The agents example (docs/agents.md) on a tiny model and 2 CPU ranks: "max g j", where the
# digits sit behind a `lookup` tool the model must call.
#   1. the tiny random Llama (word tokenizer with a chat template) and the data
#   2. HF -> Megatron conversion
#   3. SFT on 32 demonstrated episodes (one row per assistant turn)
#   4. GRPO on multi-turn episodes in sandboxed environments, through vLLM; held-out accuracy
#      and tool use before, halfway and after
# A rerun keeps what is complete and resumes GRPO from its checkpoint.
#   AGENTS_DIR=/tmp/agents bash scripts/agents_example.sh trainer.total_steps=20
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
DIR=${AGENTS_DIR:-runs/agents}
PY=${PYTHON:-.venv/bin/python}
started=$SECONDS
phase() { echo; echo "== $1   [$((SECONDS - started)) s]"; }
ranks() { PYTHON=$PY NPROC_PER_NODE=2 scripts/torchrun.sh "$@"; }

phase "1/4 tiny Llama, tokenizer with a chat template, data"
$PY -m mcore_rl.quickstart prepare-agents "$DIR"

phase "2/4 HF -> Megatron conversion"
if [ ! -d "$DIR/mcore_init" ]; then
  $PY -m mcore_rl convert hf-to-mcore --hf "$DIR/hf_init" --out "$DIR/mcore_init"
fi

phase "3/4 SFT on 32 demonstrated episodes"
if [ ! -d "$DIR/sft/model" ]; then
  ranks sft --config configs/quickstart/agents_sft.yaml init.checkpoint="$DIR/mcore_init" \
    runtime.output_dir="$DIR/sft" "sft.train_files=[$DIR/data/sft_train.jsonl]" \
    "sft.val_files=[$DIR/data/sft_val.jsonl]"
fi

phase "4/4 GRPO on multi-turn episodes with the lookup tool"
ranks train --config configs/quickstart/agents_grpo.yaml init.checkpoint="$DIR/sft/model" \
  runtime.output_dir="$DIR/grpo" "data.train_files=[$DIR/data/rl_train.jsonl]" \
  "data.val_files=[$DIR/data/rl_val.jsonl]" "$@"
echo "agents example: $((SECONDS - started)) s; held-out figures: $DIR/grpo/eval.jsonl"

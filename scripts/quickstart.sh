#!/usr/bin/env bash
# The README's main job on a fresh machine: install, then the whole path a user takes, on a
# tiny model and 2 CPU ranks:
#   1. a tiny random Llama, its tokenizer and the data of the task "max 3 8 1" -> "8"
#   2. HF -> Megatron conversion
#   3. SFT on 24 demonstrations (Megatron, TP2)
#   4. GRPO through vLLM (training PP2, rollout TP2: the weights are resharded every step),
#      held-out accuracy before, halfway and after, TensorBoard, plots, HF export
#   5. a report: accuracy before/after RL, the exported model's accuracy under transformers,
#      and where everything went
# A rerun keeps what is complete (the conversion, the SFT model) and resumes GRPO from its
# checkpoint; an SFT run that died half-way is refused, not mixed with a new one.
#   QUICKSTART_DIR=/tmp/qs bash scripts/quickstart.sh trainer.total_steps=30
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
DIR=${QUICKSTART_DIR:-runs/quickstart}
PY=.venv/bin/python
started=$SECONDS
phase() { echo; echo "== $1   [$((SECONDS - started)) s]"; }
ranks() { PYTHON=$PY NPROC_PER_NODE=2 scripts/torchrun.sh "$@"; }

phase "1/5 tiny Llama, tokenizer and data"
$PY -m mcore_rl.quickstart prepare "$DIR"

phase "2/5 HF -> Megatron conversion"
if [ ! -d "$DIR/mcore_init" ]; then
  $PY -m mcore_rl convert hf-to-mcore --hf "$DIR/hf_init" --out "$DIR/mcore_init"
fi

phase "3/5 SFT on 24 demonstrations (Megatron, TP2)"
if [ ! -d "$DIR/sft/model" ]; then
  ranks sft --config configs/quickstart/sft.yaml parallel.tensor_model_parallel_size=2 \
    init.checkpoint="$DIR/mcore_init" runtime.output_dir="$DIR/sft" \
    "sft.train_files=[$DIR/data/sft_train.jsonl]" "sft.val_files=[$DIR/data/sft_val.jsonl]"
fi

phase "4/5 GRPO through vLLM (training PP2, rollout TP2)"
ranks train --config configs/quickstart/grpo.yaml parallel.pipeline_model_parallel_size=2 \
  init.checkpoint="$DIR/sft/model" runtime.output_dir="$DIR/grpo" \
  "data.train_files=[$DIR/data/rl_train.jsonl]" "data.val_files=[$DIR/data/rl_val.jsonl]" "$@"

phase "5/5 report"
$PY -m mcore_rl.quickstart report "$DIR"
echo "quickstart: $((SECONDS - started)) s after the install"

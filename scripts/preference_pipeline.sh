#!/usr/bin/env bash
# The classic pipeline on the quickstart's task ("max 3 8 1" -> "8") with the tiny Llama on 2 CPU
# ranks (TP2): SFT, then a Bradley-Terry reward model and PPO (GAE, critic) rewarded by it, and
# DPO from the same pairs; the held-out answer accuracy (200 questions never trained on, greedy,
# transformers on the HF folders) of the SFT, PPO and DPO policies. Figures in docs/preference.md.
#   PREFERENCE_DIR=/tmp/pref bash scripts/preference_pipeline.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
DIR=${PREFERENCE_DIR:-runs/preference}
PY=${PYTHON:-.venv/bin/python}
started=$SECONDS
phase() { echo; echo "== $1   [$((SECONDS - started)) s]"; }
ranks() { PYTHON=$PY NPROC_PER_NODE=2 scripts/torchrun.sh "$@"; }
pairs() { echo "$1.train_files=[$DIR/data/pairs_train.jsonl]" "$1.val_files=[$DIR/data/pairs_val.jsonl]"; }

phase "1/6 tiny Llama, tokenizer, demonstrations and pairs"
$PY -m mcore_rl.quickstart prepare "$DIR"

phase "2/6 SFT on 24 demonstrations"
[ -d "$DIR/sft/model" ] || ranks sft --config configs/quickstart/sft.yaml parallel.tensor_model_parallel_size=2 \
  init.checkpoint=null init.hf_path="$DIR/hf_init" runtime.output_dir="$DIR/sft" \
  "sft.train_files=[$DIR/data/sft_train.jsonl]" "sft.val_files=[$DIR/data/sft_val.jsonl]"
[ -d "$DIR/sft/hf" ] || $PY -m mcore_rl convert mcore-to-hf --ckpt "$DIR/sft/model" --out "$DIR/sft/hf"

phase "3/6 reward model from the SFT weights"
[ -d "$DIR/rm/hf" ] || ranks rm --config configs/quickstart/rm.yaml init.hf_path=null \
  init.checkpoint="$DIR/sft/model" runtime.output_dir="$DIR/rm" $(pairs rm)

phase "4/6 PPO from the SFT weights, rewarded by the reward model"
[ -d "$DIR/ppo/hf" ] || ranks train --config configs/quickstart/grpo.yaml \
  parallel.tensor_model_parallel_size=2 algorithm.estimator=gae critic.micro_batch_size=32 \
  reward.model_path="$DIR/rm/hf" init.checkpoint="$DIR/sft/model" runtime.output_dir="$DIR/ppo" \
  "data.train_files=[$DIR/data/rl_train.jsonl]" "data.val_files=[$DIR/data/rl_val.jsonl]"

phase "5/6 DPO from the SFT weights"
[ -d "$DIR/dpo/hf" ] || ranks dpo --config configs/quickstart/dpo.yaml init.hf_path=null \
  init.checkpoint="$DIR/sft/model" runtime.output_dir="$DIR/dpo" $(pairs dpo)

phase "6/6 held-out answer accuracy (greedy, transformers)"
$PY - "$DIR" <<'PYTHON'
import json, sys
from mcore_rl.quickstart.files import hf_accuracy
root = sys.argv[1]
val = f"{root}/data/rl_val.jsonl"
last = lambda path: [json.loads(line) for line in open(path)][-1]
rm = last(f"{root}/rm/eval.jsonl")
print(f"reward model: held-out pair accuracy {rm['rm/val_accuracy']:.1%}, "
      f"margin {rm['rm/val_margin']:.2f}")
print(f"answer accuracy after SFT: {hf_accuracy(f'{root}/sft/hf', val):.1%}")
ppo = sorted(__import__("glob").glob(f"{root}/ppo/hf/step_*"))[-1]
print(f"answer accuracy after SFT -> RM -> PPO: {hf_accuracy(ppo, val):.1%}")
print(f"answer accuracy after SFT -> DPO: {hf_accuracy(f'{root}/dpo/hf', val):.1%}")
PYTHON
echo "done in $((SECONDS - started)) s"

#!/usr/bin/env bash
# The classic pipeline on the quickstart's task ("max 3 8 1" -> "8") with the tiny Llama on 2 CPU
# ranks (TP2): SFT, then a Bradley-Terry reward model and PPO (GAE, critic) rewarded by it
# (configs/quickstart/ppo_rm.yaml: its safeguards), and DPO from the same pairs; then the
# held-out answer accuracy (200 questions nobody trained or selected on, greedy, transformers on
# the HF folders) of the SFT, PPO and DPO policies. SEED seeds every stage (the SFT and pair
# orders, the prompt order and the sampling). Figures in docs/preference.md.
#   SEED=2 bash scripts/preference_pipeline.sh          # in runs/preference/seed_2
#   PREFERENCE_DIR=/tmp/pref bash scripts/preference_pipeline.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
SEED=${SEED:-1}
DIR=${PREFERENCE_DIR:-runs/preference/seed_$SEED}
PY=${PYTHON:-.venv/bin/python}
started=$SECONDS
phase() { echo; echo "== $1   [$((SECONDS - started)) s]"; }
ranks() { PYTHON=$PY NPROC_PER_NODE=2 scripts/torchrun.sh "$@"; }
pairs() { echo "$1.train_files=[$DIR/data/pairs_train.jsonl]" "$1.val_files=[$DIR/data/pairs_val.jsonl]" "$1.seed=$SEED"; }
seeded="runtime.seed=$SEED"

phase "1/6 tiny Llama, tokenizer, demonstrations and pairs"
$PY -m mcore_rl.quickstart prepare "$DIR"

phase "2/6 SFT on 24 demonstrations"
[ -d "$DIR/sft/model" ] || ranks sft --config configs/quickstart/sft.yaml parallel.tensor_model_parallel_size=2 \
  init.checkpoint=null init.hf_path="$DIR/hf_init" runtime.output_dir="$DIR/sft" sft.seed=$SEED $seeded \
  "sft.train_files=[$DIR/data/sft_train.jsonl]" "sft.val_files=[$DIR/data/sft_val.jsonl]"
[ -d "$DIR/sft/hf" ] || $PY -m mcore_rl convert mcore-to-hf --ckpt "$DIR/sft/model" --out "$DIR/sft/hf"

phase "3/6 reward model from the SFT weights"
[ -d "$DIR/rm/hf" ] || ranks rm --config configs/quickstart/rm.yaml init.hf_path=null \
  init.checkpoint="$DIR/sft/model" runtime.output_dir="$DIR/rm" $seeded $(pairs rm)

phase "4/6 PPO from the SFT weights, rewarded by the reward model"
[ -f "$DIR/ppo/hf/best.json" ] || ranks train --config configs/quickstart/ppo_rm.yaml \
  reward.model_path="$DIR/rm/hf" init.checkpoint="$DIR/sft/model" runtime.output_dir="$DIR/ppo" \
  "data.train_files=[$DIR/data/rlhf_train.jsonl]" "data.val_files=[$DIR/data/rlhf_dev.jsonl]" \
  data.seed=$SEED $seeded ${PPO_ARGS:-}

phase "5/6 DPO from the SFT weights"
[ -d "$DIR/dpo/hf" ] || ranks dpo --config configs/quickstart/dpo.yaml init.hf_path=null \
  init.checkpoint="$DIR/sft/model" runtime.output_dir="$DIR/dpo" $seeded $(pairs dpo)

phase "6/6 held-out answer accuracy (greedy, transformers)"
$PY -m mcore_rl.quickstart preference-report "$DIR"
echo "done in $((SECONDS - started)) s"

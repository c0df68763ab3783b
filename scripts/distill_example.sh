#!/usr/bin/env bash
# The on-policy distillation example (docs/distillation.md) on tiny models and 2 CPU ranks: the
# quickstart's SFT model is the student; no reward trains it, only its teacher's log-probs.
#   1. the quickstart (scripts/quickstart.sh: data, tiny Llama, SFT, GRPO), kept if complete
#   2. a wider, deeper tiny Llama (hidden 256, 3 layers) through the same path: SFT, GRPO
#   3. distillation from the quickstart's GRPO model (the student's size)
#   4. distillation from the wide GRPO model, the teacher at TP2 beside the student at PP2
#   5. a report: held-out accuracy before/after against the teachers' and GRPO's own run
# A rerun keeps what is complete and resumes what is not.
#   QUICKSTART_DIR=/tmp/qs bash scripts/distill_example.sh trainer.total_steps=30
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
DIR=${QUICKSTART_DIR:-runs/quickstart}
PY=.venv/bin/python
started=$SECONDS
phase() { echo; echo "== $1   [$((SECONDS - started)) s]"; }
ranks() { PYTHON=$PY NPROC_PER_NODE=2 scripts/torchrun.sh "$@"; }
data=("data.train_files=[$DIR/data/rl_train.jsonl]" "data.val_files=[$DIR/data/rl_val.jsonl]")

phase "1/5 the quickstart (student: its SFT model; teacher: its GRPO model)"
if [ ! -d "$DIR/grpo/hf/step_00000060" ]; then
  QUICKSTART_DIR=$DIR bash scripts/quickstart.sh
fi

phase "2/5 a wider teacher (hidden 256, 3 layers): conversion, SFT, GRPO"
$PY -m mcore_rl.quickstart prepare-wide-teacher "$DIR"
WIDE=$DIR/wide
if [ ! -d "$WIDE/mcore_init" ]; then
  $PY -m mcore_rl convert hf-to-mcore --hf "$WIDE/hf_init" --out "$WIDE/mcore_init"
fi
if [ ! -d "$WIDE/sft/model" ]; then
  ranks sft --config configs/quickstart/sft.yaml parallel.tensor_model_parallel_size=2 \
    init.checkpoint="$WIDE/mcore_init" runtime.output_dir="$WIDE/sft" \
    "sft.train_files=[$DIR/data/sft_train.jsonl]" "sft.val_files=[$DIR/data/sft_val.jsonl]"
fi
ranks train --config configs/quickstart/grpo.yaml parallel.tensor_model_parallel_size=2 \
  init.checkpoint="$WIDE/sft/model" runtime.output_dir="$WIDE/grpo" "${data[@]}"

phase "3/5 distillation from the quickstart's GRPO model, no reward"
ranks train --config configs/quickstart/distill.yaml parallel.pipeline_model_parallel_size=2 \
  init.checkpoint="$DIR/sft/model" teacher.init.hf_path="$DIR/grpo/hf/step_00000060" \
  runtime.output_dir="$DIR/distill" "${data[@]}" "$@"

phase "4/5 distillation from the wide teacher (teacher TP2, student PP2), no reward"
ranks train --config configs/quickstart/distill.yaml parallel.pipeline_model_parallel_size=2 \
  init.checkpoint="$DIR/sft/model" teacher.init.hf_path="$WIDE/grpo/hf/step_00000060" \
  teacher.parallel.tensor_model_parallel_size=2 teacher.parallel.pipeline_model_parallel_size=1 \
  runtime.output_dir="$DIR/distill_wide" "${data[@]}" "$@"

phase "5/5 report"
$PY -m mcore_rl.quickstart distill-report "$DIR"
echo "distillation example: $((SECONDS - started)) s"

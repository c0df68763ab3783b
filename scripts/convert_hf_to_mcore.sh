#!/usr/bin/env bash
# HF folder -> mcore_rl (Megatron distributed) checkpoint.
#
#   scripts/convert_hf_to_mcore.sh HF_DIR OUT_DIR [TP] [PP] [EP]
#
# Single process by default (the checkpoint loads at any layout). NPROC=TPxPPxEP converts with
# one process per target rank, each reading only its share (an MoE rank: only its experts):
#   NPROC=8 scripts/convert_hf_to_mcore.sh /models/Llama-3-8B ckpt/llama3-8b 4 2
#   NPROC=8 scripts/convert_hf_to_mcore.sh /models/Qwen3-30B-A3B ckpt/qwen3-30b-a3b 2 1 4
set -euo pipefail
if [ "$#" -lt 2 ]; then sed -n '2,10p' "$0" >&2; exit 2; fi
HF_DIR=$1 OUT_DIR=$2 TP=${3:-1} PP=${4:-1} EP=${5:-1}
ARGS=(convert hf-to-mcore --hf "$HF_DIR" --out "$OUT_DIR" --tp "$TP" --pp "$PP" --ep "$EP")
if [ "${NPROC:-1}" -gt 1 ]; then
  NPROC_PER_NODE=$NPROC exec "$(dirname "$0")/torchrun.sh" "${ARGS[@]}"
fi
exec "${PYTHON:-python3}" -m mcore_rl "${ARGS[@]}"

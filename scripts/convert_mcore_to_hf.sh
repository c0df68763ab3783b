#!/usr/bin/env bash
# mcore_rl checkpoint -> HF folder (safetensors, config.json, tokenizer).
#
#   scripts/convert_mcore_to_hf.sh CKPT_DIR OUT_DIR
#
# NPROC=N writes the output files from N processes (files dealt round-robin).
set -euo pipefail
if [ "$#" -lt 2 ]; then sed -n '2,6p' "$0" >&2; exit 2; fi
ARGS=(convert mcore-to-hf --ckpt "$1" --out "$2")
if [ "${NPROC:-1}" -gt 1 ]; then
  NPROC_PER_NODE=$NPROC exec "$(dirname "$0")/torchrun.sh" "${ARGS[@]}"
fi
exec "${PYTHON:-python3}" -m mcore_rl "${ARGS[@]}"

#!/usr/bin/env bash
# The README's main job on a fresh machine: install, then GRPO on the toy copy task with a tiny
# random-init model at TP2 x PP2 on 4 CPU ranks, generating through vLLM (rollout TP2) and
# evaluating held-out prompts before, halfway and at the end (about 3 minutes after install).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
PYTHON=.venv/bin/python NPROC_PER_NODE=${NPROC_PER_NODE:-4} \
  scripts/torchrun.sh train --config configs/grpo_toy.yaml \
  parallel.tensor_model_parallel_size=2 parallel.pipeline_model_parallel_size=2 \
  rollout.rollout_tp=2 "$@"

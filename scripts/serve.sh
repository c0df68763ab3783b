#!/usr/bin/env bash
# Serve a trained model with the project's environment: vLLM's OpenAI-compatible server plus the
# seed's POST /generate (see docs/serving.md). MODEL is an HF folder (RUN_DIR/hf/step_N) or an
# mcore_rl weights checkpoint; every other flag goes to vLLM (--port, --api-key,
# --tensor-parallel-size, --max-model-len, --dtype ...). Binds 127.0.0.1 unless --host is given.
#
#   scripts/serve.sh runs/quickstart/grpo/hf/step_00000060 --dtype float32 --port 8000
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { sed -n '2,7p' "$0" >&2; exit 2; }
PY=${PYTHON:-.venv/bin/python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if ! "$PY" -c 'import torch; assert torch.cuda.is_available()' 2> /dev/null; then
  export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}   # GiB of KV cache on a CPU
fi
exec "$PY" -m mcore_rl serve "$@"

#!/usr/bin/env bash
# One command that proves the GPU path: each stage in a fresh process with a timeout, one JSON
# line per stage, then a PASS/FAIL table; the exit status is non-zero when any stage failed.
#
#   scripts/gpu_validate.sh                     # one GPU, every stage (about 5 minutes, H100)
#   scripts/gpu_validate.sh --gpus 2            # every stage under torchrun with 2 ranks (TP2;
#                                               # the RL stage generates with vLLM if it imports)
#   scripts/gpu_validate.sh --stages parity,rl  # some stages
#   scripts/gpu_validate.sh --stages performance --sequence 8192  # the throughput at 8k
#   scripts/gpu_validate.sh --cpu --tiny        # on a CPU machine, tiny models (CI runs this)
#
# Stages: preflight smoke performance offload parity rl resume moe lora distill (docs/gpu.md says
# what each checks; resume continues the run rl saved).
# Results go to $GPU_VALIDATE_OUT (default gpu_validate_results/): results.jsonl and a log per
# stage. A machine with only torch and transformers needs megatron-core and omegaconf: put their
# wheels in $GPU_WHEELS (default .whl/; scripts/gpu_wheels.sh downloads them where pip works);
# when those two do not import, the wheels are installed into a private folder first, nothing
# else is touched.
set -uo pipefail
cd "$(dirname "$0")/.."

STAGES="preflight,smoke,performance,offload,parity,rl,resume,moe,lora,distill,delta"
GPUS=1
FLAGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --gpus) GPUS=$2; shift 2 ;;
    --stages) STAGES=$2; shift 2 ;;
    --cpu|--tiny) FLAGS+=("$1"); shift ;;
    --sequence) FLAGS+=(--sequence "$2"); shift 2 ;;
    *) sed -n '2,18p' "$0" >&2; exit 2 ;;
  esac
done

PYTHON=${PYTHON:-python3}
OUT=${GPU_VALIDATE_OUT:-gpu_validate_results}
mkdir -p "$OUT"
RESULTS="$OUT/results.jsonl"
: > "$RESULTS"
WORKDIR=$(mktemp -d -t gpu_validate_XXXXXX)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONUNBUFFERED=1
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

WHEELS=${GPU_WHEELS:-.whl}
if compgen -G "$WHEELS/*.whl" > /dev/null \
    && ! "$PYTHON" -c 'import megatron.core, omegaconf' 2> /dev/null; then
  SITE="$WORKDIR/site"
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl \
    || { echo "installing the wheels in $WHEELS/ failed" >&2; exit 1; }
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ "$GPUS" -gt 1 ]; then
  # The rendezvous store takes a port the system hands out: runs at once on one machine
  # do not collide.
  LAUNCH=("$PYTHON" -m torch.distributed.run --nproc_per_node "$GPUS" --rdzv-backend c10d
          --rdzv-endpoint 127.0.0.1:0 --local-addr 127.0.0.1 --log-dir /dev/null)
  "$PYTHON" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("vllm") is None)' \
    && FLAGS+=(--vllm)
else
  LAUNCH=("$PYTHON")
fi

declare -A LIMIT=([preflight]=120 [smoke]=180 [performance]=300 [offload]=240 [parity]=240
                  [rl]=300 [resume]=300 [moe]=300 [lora]=300 [distill]=300
                  [delta]=120)
for stage in ${STAGES//,/ }; do
  [ -n "${LIMIT[$stage]:-}" ] || { echo "unknown stage $stage" >&2; exit 2; }
  echo "== $stage (at most ${LIMIT[$stage]} s; log $OUT/$stage.log)"
  started=$SECONDS
  timeout --kill-after=20 "${LIMIT[$stage]}" "${LAUNCH[@]}" scripts/gpu_validate.py \
    --stage "$stage" --out "$RESULTS" --workdir "$WORKDIR" "${FLAGS[@]}" > "$OUT/$stage.log" 2>&1
  status=$?
  if ! grep -q "\"stage\": \"$stage\"" "$RESULTS"; then
    why="exit status $status"
    [ "$status" -eq 124 ] || [ "$status" -eq 137 ] && why="timed out after ${LIMIT[$stage]} s"
    printf '{"stage": "%s", "ok": false, "seconds": %d, "failed": ["%s (see %s)"]}\n' \
      "$stage" $((SECONDS - started)) "$why" "$OUT/$stage.log" >> "$RESULTS"
  fi
done
rm -rf "$WORKDIR"

"$PYTHON" - "$RESULTS" <<'PY'
import json, sys
records = [json.loads(line) for line in open(sys.argv[1])]
print(f"\n{'stage':<12} {'result':<6} {'seconds':>7}  figures / failed checks")
for record in records:
    figures = {k: v for k, v in record.items() if k not in ("stage", "ok", "seconds", "failed")}
    text = "; ".join(record["failed"]) if record["failed"] else \
        ", ".join(f"{k}={v}" for k, v in figures.items())
    print(f"{record['stage']:<12} {'PASS' if record['ok'] else 'FAIL':<6} "
          f"{record['seconds']:>7}  {text}")
sys.exit(0 if all(record["ok"] for record in records) else 1)
PY

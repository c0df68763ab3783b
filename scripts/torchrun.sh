#!/usr/bin/env bash
# Launch an mcore_rl job on this node with torchrun: every rank runs `python -m mcore_rl "$@"`.
#
#   scripts/torchrun.sh smoke --config configs/smoke.yaml [key=value ...]
#
# One node (defaults; any number of jobs at once on one machine: each takes a free port) or many
# (run the same command on every node with NODE_RANK set):
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 NPROC_PER_NODE=8 scripts/torchrun.sh ...
#
# Environment (all optional):
#   NPROC_PER_NODE  processes on this node (default: GPUs visible, else 4 CPU ranks)
#   NNODES          nodes in the job (default 1)
#   NODE_RANK       this node's index (default 0)
#   MASTER_ADDR     host of node 0 (default 127.0.0.1)
#   MASTER_PORT     rendezvous port on node 0 (default: one node: a free port the system picks;
#                   several nodes: 29500)
#   OMP_NUM_THREADS threads per rank (default 1: more oversubscribes small CPU machines)
#   PYTHON          interpreter (default python3)
#   TORCHRUN_ARGS   extra torchrun flags, e.g. "--max-restarts 3"
set -euo pipefail

if [ "$#" -eq 0 ]; then
  sed -n '2,19p' "$0" >&2
  exit 2
fi

# When the launch started, for the ranks' start-up breakdown (mcore_rl.observability.startup).
export MCORE_RL_LAUNCHED_AT=$(date +%s.%N)
PYTHON=${PYTHON:-python3}
if [ -z "${NPROC_PER_NODE:-}" ]; then
  NPROC_PER_NODE=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() or 4)')
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
if [ "$NNODES" -eq 1 ] && [ -z "${MASTER_PORT:-}" ]; then
  # One node and no port given: torchrun's rendezvous store binds port 0, so the system hands
  # it a free one (no window in which another job could take it) and the ranks get it as
  # MASTER_PORT. A fixed default would make a second job on this machine fail (EADDRINUSE).
  RENDEZVOUS=(--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:0" --local-addr "$MASTER_ADDR")
else
  # Several nodes: every node must name the same port on node 0.
  MASTER_PORT=${MASTER_PORT:-29500}
  RENDEZVOUS=(--node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# A fixed glibc mmap threshold: freed host tensors of 1 MiB and more (activations) go back to the
# system instead of fragmenting the heap (docs/training.md, "Memory on the TRL bench").
export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-1048576}

# A job the ranks would refuse is reported once, here, before any rank starts: the check runs in
# torchrun's own process (mcore_rl.launch_check --torchrun), which starts the ranks only after it
# has passed (exit status 2 otherwise); one interpreter and one import of torch for both.
# --log-dir /dev/null: without a log folder torchrun makes /tmp/torchelastic_* for every launch and
# never removes it; the ranks write no error files there (no @record), so nothing is lost.
# shellcheck disable=SC2086  # TORCHRUN_ARGS is a list of flags
exec "$PYTHON" -m mcore_rl.launch_check --as torchrun.sh "$((NNODES * NPROC_PER_NODE))" \
  "$NNODES" "$NPROC_PER_NODE" "$@" --torchrun \
  --nnodes "$NNODES" --nproc_per_node "$NPROC_PER_NODE" "${RENDEZVOUS[@]}" --log-dir /dev/null \
  ${TORCHRUN_ARGS:-} \
  -m mcore_rl "$@"

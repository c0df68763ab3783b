#!/usr/bin/env bash
# Inside a SLURM allocation: check the job against the config, start every rank of
# `mcore-rl COMMAND --config CONFIG key=value ...`, and requeue the job when the trainer saved and
# stopped on the preemption signal (exit code 75). The train_*.sbatch scripts call it; it also
# works in `salloc`.
#
#   scripts/slurm/launch.sh CONFIG [key=value ...]
#
# Environment (all optional; sbatch passes the submitting shell's environment on):
#   LAUNCHER         srun (default): srun starts one task per rank; mcore_rl reads
#                    SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID, MASTER_ADDR/MASTER_PORT come from here.
#                    torchrun: srun starts one torchrun per node (c10d rendezvous on the first node),
#                    which starts the node's ranks.
#   MCORE_RL_COMMAND mcore-rl sub-command (default train; smoke works too)
#   PYTHON           interpreter with mcore_rl installed (default: .venv/bin/python of this
#                    checkout if present, else python3)
#   GPUS_PER_NODE    GPUs per node; when > 0 each node must run one rank per GPU (default:
#                    SLURM_GPUS_ON_NODE, else 0 = CPU ranks, gloo)
#   MASTER_ADDR      rendezvous host (default: NodeAddr of the allocation's first node)
#   MASTER_PORT      rendezvous port (default: 15000 + job id % 10000)
#   EXIT_GRACE       seconds srun lets the other ranks run once one has exited (default 300);
#                    then it kills them, so a crashed rank cannot leave the others hanging
#   SRUN_ARGS, TORCHRUN_ARGS  extra flags for srun / torchrun; containers (enroot/pyxis):
#                    SRUN_ARGS="--container-image=IMG.sqsh --container-mounts=$PWD:$PWD
#                    --container-workdir=$PWD" PYTHON=python (see docs/slurm.md)
#   CHECK_IN_STEP=1  run the config/layout check in a one-task job step instead of on the batch
#                    host (automatic with --container-image in SRUN_ARGS)
#   DRY_RUN=1        check and print the launch command, start nothing
#
# Networks: NCCL and Gloo pick an interface themselves; on nodes with several (Ethernet +
# InfiniBand, or a hostname resolving to 127.0.1.1) export them before sbatch, e.g.
#   NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=ib0 NCCL_IB_HCA=mlx5 (see docs/slurm.md).
set -uo pipefail

PREEMPTED=75  # mcore-rl train: saved a checkpoint after trainer.save_signal, resume me

die() { echo "launch.sh: error: $*" >&2; exit 2; }

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
[ "$#" -ge 1 ] || die "usage: launch.sh CONFIG [key=value ...] (the config file is missing)"
CONFIG=$1
shift
COMMAND=${MCORE_RL_COMMAND:-train}
LAUNCHER=${LAUNCHER:-srun}

# --- the config file and the interpreter ---------------------------------------------------
[ -e "$CONFIG" ] || die "config file '$CONFIG' does not exist (relative paths are taken from $(pwd))"
[ -f "$CONFIG" ] || die "config path '$CONFIG' is not a file"
[ -r "$CONFIG" ] || die "config file '$CONFIG' is not readable"
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then PYTHON=$REPO/.venv/bin/python; else PYTHON=python3; fi
fi
command -v "$PYTHON" >/dev/null || die "PYTHON=$PYTHON is not an executable"
case $LAUNCHER in srun|torchrun) ;; *) die "LAUNCHER=$LAUNCHER must be srun or torchrun" ;; esac

# --- the allocation ------------------------------------------------------------------------
[ -n "${SLURM_JOB_ID:-}" ] || die "not inside a SLURM allocation (submit with sbatch, or salloc)"
NNODES=${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:-1}}
NTASKS=${SLURM_NTASKS:-}
[ -n "$NTASKS" ] || die "SLURM_NTASKS is not set: request ranks with --ntasks-per-node"
[ $((NTASKS % NNODES)) -eq 0 ] ||
  die "$NTASKS tasks do not spread evenly over $NNODES nodes; use --ntasks-per-node"
RANKS_PER_NODE=$((NTASKS / NNODES))
WORLD=$NTASKS
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-0}}
if [ "$GPUS_PER_NODE" -gt 0 ] && [ "$RANKS_PER_NODE" -ne "$GPUS_PER_NODE" ]; then
  die "one rank per GPU: the job has $RANKS_PER_NODE ranks per node (--ntasks-per-node) but" \
      "$GPUS_PER_NODE GPUs per node (--gpus-per-node / GPUS_PER_NODE)"
fi

# --- the layout: world size against the config + overrides, before any rank starts ---------
# Runs here on the batch host, or as a one-task job step where mcore_rl lives only inside the
# ranks' container (CHECK_IN_STEP=1; automatic when SRUN_ARGS has --container-image).
check=("$PYTHON")
# shellcheck disable=SC2206  # SRUN_ARGS is a list of flags
if [ "${CHECK_IN_STEP:-0}" = 1 ] || [[ "${SRUN_ARGS:-}" == *--container-image* ]]; then
  check=(srun --nodes=1 --ntasks=1 ${SRUN_ARGS:-} "$PYTHON")
fi
"${check[@]}" -m mcore_rl.launch_check --as launch.sh "$WORLD" "$NNODES" "$RANKS_PER_NODE" \
  "$COMMAND" --config "$CONFIG" "$@"
status=$?
if [ "$status" -ne 0 ]; then
  [ "$status" -eq 2 ] || echo "launch.sh: error: $PYTHON cannot run mcore_rl.launch_check (exit" \
    "status $status): set PYTHON, or CHECK_IN_STEP=1 when mcore_rl is installed only where the" \
    "ranks run" >&2
  exit 2
fi

# --- rendezvous ----------------------------------------------------------------------------
FIRST_NODE=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}" 2>/dev/null | head -n 1)
FIRST_NODE=${FIRST_NODE:-$(hostname)}
if [ -z "${MASTER_ADDR:-}" ]; then
  # The address SLURM itself uses for the node (NodeAddr); usually its hostname.
  MASTER_ADDR=$(scontrol show node "$FIRST_NODE" 2>/dev/null | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
  MASTER_ADDR=${MASTER_ADDR:-$FIRST_NODE}
fi
MASTER_PORT=${MASTER_PORT:-$((15000 + SLURM_JOB_ID % 10000))}
export MASTER_ADDR MASTER_PORT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
export PYTHONUNBUFFERED=1  # per-step lines reach the job log as they happen

# --- launch --------------------------------------------------------------------------------
# srun's exit code is the highest of its tasks' (128 + n for a task killed by signal n).
# shellcheck disable=SC2206  # SRUN_ARGS / TORCHRUN_ARGS are lists of flags
if [ "$LAUNCHER" = srun ]; then
  # Each task is one rank: mcore_rl reads SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID.
  launch=(srun --kill-on-bad-exit=0 --wait="${EXIT_GRACE:-300}" ${SRUN_ARGS:-}
          "$PYTHON" -m mcore_rl "$COMMAND" --config "$CONFIG" "$@")
else
  # One task per node holding all of the node's CPUs (and, by default, all its GPUs).
  launch=(srun --ntasks="$NNODES" --ntasks-per-node=1 --cpus-per-task="${SLURM_CPUS_ON_NODE:-1}"
          --kill-on-bad-exit=0 --wait="${EXIT_GRACE:-300}" ${SRUN_ARGS:-}
          bash "$HERE/torchrun_node.sh" "$PYTHON"
          --nnodes "$NNODES" --nproc_per_node "$RANKS_PER_NODE"
          --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$SLURM_JOB_ID"
          --log-dir /dev/null ${TORCHRUN_ARGS:-} -m mcore_rl "$COMMAND" --config "$CONFIG" "$@")
fi
say() { echo "launch.sh: $(date +%T): $*"; }
say "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): $NNODES node(s) x" \
     "$RANKS_PER_NODE rank(s) = world $WORLD via $LAUNCHER, rendezvous $MASTER_ADDR:$MASTER_PORT"
say "${launch[*]}"
[ "${DRY_RUN:-0}" = 1 ] && exit 0

"${launch[@]}"
code=$?
if [ "$code" -eq "$PREEMPTED" ]; then
  say "the ranks saved a checkpoint on the preemption signal; requeueing job $SLURM_JOB_ID"
  if scontrol requeue "$SLURM_JOB_ID"; then
    exit 0  # usually not reached: the requeue ends this batch script
  fi
  echo "launch.sh: error: scontrol requeue failed (submit with --requeue); resubmit to resume" >&2
fi
say "ranks finished with exit code $code"
exit "$code"

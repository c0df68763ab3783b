#!/usr/bin/env bash
# One per node under srun (launch.sh with LAUNCHER=torchrun): torchrun starting this node's ranks.
#
#   torchrun_node.sh PYTHON TORCHRUN_ARGS... -m mcore_rl train ...
#
# Preemption: SLURM sends the --signal (USR1) to every process of the job step, ranks included.
# torchrun does not handle SIGUSR1, so it would die of it and leave its ranks behind; it runs
# here with the signal ignored while the ranks install their own handler (trainer.save_signal),
# save a checkpoint and exit 75. torchrun reports any failed rank as its own exit code 1, so when
# torchrun fails after the signal has arrived this wrapper exits 75 for it (launch.sh requeues).
set -u
PYTHON=$1
shift
signal=${SAVE_SIGNAL:-USR1}
signalled=0
trap 'signalled=1' "$signal"
(trap '' "$signal"; exec "$PYTHON" -m torch.distributed.run "$@") &
pid=$!
code=0
while kill -0 "$pid" 2>/dev/null; do
  wait "$pid"  # returns early when the trap runs; loop until torchrun has really exited
  code=$?
done
if [ "$code" -ne 0 ] && [ "$signalled" -eq 1 ]; then
  echo "torchrun_node.sh: torchrun exited $code after SIG$signal: reporting 75 (saved, requeue)" >&2
  exit 75
fi
exit "$code"

#!/usr/bin/env bash
# A real SLURM cluster on this one machine, for tests and for trying the sbatch scripts: munged,
# slurmctld and NODES slurmd daemons (emulated nodes n1..nN, all on 127.0.0.1), no systemd.
# Everything (slurm.conf, state, spool, logs, pid files, the munge key and socket) lives under
# DIR; client commands find it through SLURM_CONF. Needs root (munged and slurmd run as root).
#
#   scripts/slurm/local_cluster.sh install      # apt-get install slurmctld slurmd slurm-client munge
#   scripts/slurm/local_cluster.sh start DIR    # prints: export SLURM_CONF=DIR/slurm.conf
#   export SLURM_CONF=DIR/slurm.conf; sbatch ...; squeue
#   scripts/slurm/local_cluster.sh stop DIR     # cancels jobs, stops the daemons by their pids
#
# Environment for `start` (all optional):
#   NODES       emulated nodes (default 2)
#   CPUS        CPUs declared per node (default 8; overstated on purpose, the nodes share the
#               real cores; slurmd is told to trust the configuration)
#   PORT_BASE   slurmctld port; the slurmds use the next NODES ports (default: free ports)
#   CRED_EXPIRE seconds a requeued job waits before it may start again (default 5; SLURM's 120)
set -euo pipefail
export PATH=$PATH:/usr/sbin:/sbin  # the daemons live there

usage() { sed -n '2,17p' "$0" >&2; exit 2; }
[ "$#" -ge 1 ] || usage
action=$1

if [ "$action" = install ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo=sudo
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge
  exit 0
fi

[ "$#" -eq 2 ] || usage
mkdir -p "$2"
DIR=$(cd "$2" && pwd)
CONF=$DIR/slurm.conf

daemon_pid() {  # the pid in FILE if it is still that daemon (pids get reused)
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 0
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ] && echo "$pid"
  return 0
}

stop_pids() {  # SIGTERM (a daemon takes ~2 s to exit), SIGKILL after 10 s
  local pid alive
  for pid in "$@"; do kill "$pid" 2>/dev/null || true; done
  for _ in $(seq 100); do
    alive=0
    for pid in "$@"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" -eq 0 ] && return 0
    sleep 0.1
  done
  for pid in "$@"; do kill -9 "$pid" 2>/dev/null || true; done
}

if [ "$action" = stop ]; then
  export SLURM_CONF=$CONF
  if [ -f "$CONF" ] && scontrol ping >/dev/null 2>&1; then
    scancel --full --signal=KILL --state=RUNNING --quiet --user "$(id -un)" 2>/dev/null || true
    scancel --quiet --user "$(id -un)" 2>/dev/null || true
    for _ in $(seq 50); do
      [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break
      sleep 0.2
    done
  fi
  # The slurmds and the controller together, munge (their authentication) last.
  daemons=()
  for file in "$DIR"/run/slurmd-*.pid; do daemons+=($(daemon_pid "$file" slurmd)); done
  daemons+=($(daemon_pid "$DIR/run/slurmctld.pid" slurmctld))
  [ "${#daemons[@]}" -eq 0 ] || stop_pids "${daemons[@]}"
  munged=$(daemon_pid "$DIR/run/munged.pid" munged)
  [ -z "$munged" ] || stop_pids "$munged"
  rm -f "$DIR"/run/*.pid
  exit 0
fi

[ "$action" = start ] || usage
for tool in munged slurmctld slurmd sbatch; do
  command -v "$tool" >/dev/null || {
    echo "local_cluster.sh: $tool is not installed; run: scripts/slurm/local_cluster.sh install" >&2
    exit 1
  }
done
for file in "$DIR"/run/*.pid; do
  [ -f "$file" ] || continue
  name=$(basename "$file" .pid)
  if [ -n "$(daemon_pid "$file" "${name%%-*}")" ]; then
    echo "local_cluster.sh: a cluster is already running in $DIR ($name); stop it first" >&2
    exit 1
  fi
done

NODES=${NODES:-2}
CPUS=${CPUS:-8}
CRED_EXPIRE=${CRED_EXPIRE:-5}
if [ -n "${PORT_BASE:-}" ]; then
  ports=$(seq "$PORT_BASE" $((PORT_BASE + NODES)))
else
  ports=$(python3 - "$NODES" <<'PY'
import socket, sys
held = [socket.socket() for _ in range(int(sys.argv[1]) + 1)]
for s in held:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in held))
PY
)
fi
read -r -a ports <<<"$(echo $ports)"

# munged refuses directories that others can write to, and keys that others can read.
umask 022
mkdir -p "$DIR"/{munge,state,log,run,spool}
chmod 700 "$DIR/munge"
[ -f "$DIR/munge/munge.key" ] || mungekey --create --keyfile="$DIR/munge/munge.key"
chmod 400 "$DIR/munge/munge.key"
SOCKET=$DIR/munge/munge.socket.2
munged --key-file="$DIR/munge/munge.key" --socket="$SOCKET" \
  --pid-file="$DIR/run/munged.pid" --log-file="$DIR/log/munged.log" \
  --seed-file="$DIR/munge/munged.seed" --force

cat >"$CONF" <<EOF
# Written by scripts/slurm/local_cluster.sh: a ${NODES}-node cluster emulated on localhost.
ClusterName=localcluster
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=${ports[0]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCKET,cred_expire=$CRED_EXPIRE
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=bf_interval=1,sched_interval=1
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=10
EOF
for i in $(seq "$NODES"); do
  echo "NodeName=n$i NodeHostname=localhost NodeAddr=127.0.0.1 Port=${ports[$i]} CPUs=$CPUS State=UNKNOWN" >>"$CONF"
  mkdir -p "$DIR/spool/n$i"
done
echo "PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES" >>"$CONF"

export SLURM_CONF=$CONF
slurmctld -i -f "$CONF"
for i in $(seq "$NODES"); do
  slurmd -N "n$i" -f "$CONF"
done

# Up when every node reports idle.
for _ in $(seq 300); do
  idle=$(sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 == "idle"' | wc -l)
  [ "$idle" -eq "$NODES" ] && { echo "export SLURM_CONF=$CONF"; exit 0; }
  sleep 0.2
done
echo "local_cluster.sh: the cluster in $DIR did not come up within 60 s; sinfo says:" >&2
sinfo -N >&2 || true
tail -n 20 "$DIR"/log/*.log >&2 || true
exit 1

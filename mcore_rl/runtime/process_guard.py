"""No process outlives its job.

torchrun starts every rank in a session of its own, so killing torchrun - even its whole process
group with `kill -9 -PGID`, or a test's timeout killing it - leaves the ranks running (they keep
training, with nobody to supervise or restart them), and with them their reward workers and
multiprocessing's resource tracker. SLURM kills a job's whole cgroup; a workstation or a CI
machine has nothing that does. So a rank started by torchrun asks the kernel to SIGKILL it
when its parent, torchrun's agent, dies (Linux's PR_SET_PDEATHSIG). Its children follow on
their own (reward workers exit once their parent is gone, rewards.sandbox; the resource tracker
when its last user has), except a multiprocessing Manager (below).

Outside torchrun nothing changes: a job started by a shell must survive that shell (nohup).

A rank's own helpers need the same in the other direction. A rank killed without cleanup
(SIGKILL, the OOM killer) leaves its children running: torchrun signals the process groups of
ranks still alive, not the group of one that has died, and a multiprocessing Manager (Megatron's
torch_dist checkpoint writer starts one per rank at the first save, about 275 MB) never checks
for its parent. So `guard_helper_processes` hands the rank's multiprocessing children to a small
guard process (no torch) that the kernel signals when the rank dies, and that then kills them.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1
LAUNCHED_BY_TORCHRUN = "TORCHELASTIC_RUN_ID"
"""An environment variable torchrun sets for every rank it starts."""


def exit_with_launcher() -> bool:
    """Under torchrun on Linux: be killed when torchrun's agent dies (exit now if it already
    has). Returns whether the guard is set."""
    if LAUNCHED_BY_TORCHRUN not in os.environ or not sys.platform.startswith("linux"):
        return False
    launcher = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return False
    if os.getppid() != launcher:  # the agent died before the guard was set
        os._exit(1)
    return True



_GUARD_SOURCE = """
import ctypes, os, signal, sys
owner, helpers = int(sys.argv[1]), []
for pid in sys.argv[2:]:
    try:
        helpers.append(os.pidfd_open(int(pid)))
    except ProcessLookupError:
        pass

def end(*_):
    for pidfd in helpers:
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os._exit(0)

signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, end)
ctypes.CDLL(None, use_errno=True).prctl(%d, signal.SIGTERM, 0, 0, 0)
if os.getppid() != owner:
    end()
while True:
    signal.pause()
""" % PR_SET_PDEATHSIG
"""A guard: holds a pidfd of each helper (a pidfd names that process, never a later one with the
same number) and SIGKILLs them when the kernel sends SIGTERM for its owner's death, or anyone
else does (torchrun ending the owner's process group). Ctrl-C is the owner's to handle."""

_guards: list[subprocess.Popen] = []
_guarded: set[int] = set()


def guard_helper_processes() -> None:
    """Have this process's multiprocessing children (those not handed over yet) SIGKILLed when
    this process dies, however it dies: one guard process per call that finds new children.
    Linux 5.3+ (pidfds); elsewhere nothing happens."""
    if not sys.platform.startswith("linux") or not hasattr(os, "pidfd_open"):
        return
    helpers = sorted({child.pid for child in multiprocessing.active_children()} - _guarded)
    if helpers:
        _guards.append(subprocess.Popen([sys.executable, "-I", "-S", "-c", _GUARD_SOURCE,
                                         str(os.getpid()), *map(str, helpers)]))
        _guarded.update(helpers)

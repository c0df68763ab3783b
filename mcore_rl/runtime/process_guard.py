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
for its parent. A Manager also dies of SIGUSR1, which SLURM's `--signal` sends to every process
of a step to trigger the preemption save, the save that needs it. So a rank starts such helpers
inside `helper_processes_guarded`: with its own signals blocked, and handed afterwards to a small
guard process (no torch) that the kernel signals when the rank dies, and that then kills them.
"""

from __future__ import annotations

import contextlib
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
signal.pthread_sigmask(signal.SIG_SETMASK, [])
owner, helpers = int(sys.argv[1]), []
for pid in sys.argv[2:]:
    try:
        helpers.append(os.pidfd_open(int(pid)))
    except ProcessLookupError:
        pass

def end_if_orphaned(*_):
    if os.getppid() == owner:
        return
    for pidfd in helpers:
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os._exit(0)

for owners_signal in (signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(owners_signal, signal.SIG_IGN)
signal.signal(signal.SIGTERM, end_if_orphaned)
ctypes.CDLL(None, use_errno=True).prctl(%d, signal.SIGTERM, 0, 0, 0)
end_if_orphaned()
while True:
    signal.pause()
""" % PR_SET_PDEATHSIG
"""A guard: holds a pidfd of each helper (a pidfd names that process, never a later one with the
same number) and SIGKILLs them once its owner has died (the kernel's SIGTERM for it). Signals
sent to the whole job (SLURM's --signal, its SIGTERM at the time limit, Ctrl-C) leave a guard
whose owner lives as it is."""

_guards: list[subprocess.Popen] = []
_guarded: set[int] = set()


@contextlib.contextmanager
def helper_processes_guarded():
    """For a block that may start helper processes (Megatron's checkpoint writer starts its
    Manager in the first save). They start with the signals this process handles itself
    blocked, so that a signal sent to every process of a job step (SLURM's `--signal=USR1`, the
    preemption save's trigger) does not kill them in the middle of that save; this process
    still gets those signals. After the block they are SIGKILLed whenever this process dies,
    however it dies (Linux 5.3+, which has pidfds; elsewhere only the blocking applies)."""
    handled = [number for number in signal.valid_signals()
               if callable(signal.getsignal(number))]
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, handled)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    if sys.platform.startswith("linux") and hasattr(os, "pidfd_open"):
        _guard(sorted({child.pid for child in multiprocessing.active_children()} - _guarded))


def _guard(helpers: list[int]) -> None:
    """A guard process for these helpers (none when there are none)."""
    if helpers:
        _guards.append(subprocess.Popen([sys.executable, "-I", "-S", "-c", _GUARD_SOURCE,
                                         str(os.getpid()), *map(str, helpers)]))
        _guarded.update(helpers)

"""No process outlives its job.

torchrun starts every rank in a session of its own, so killing torchrun - even its whole process
group with `kill -9 -PGID`, or a test's timeout killing it - leaves the ranks running (they keep
training, with nobody to supervise or restart them), and with them their reward workers and
multiprocessing's resource tracker. SLURM kills a job's whole cgroup; a workstation or a CI
machine has nothing that does. So a rank started by torchrun asks the kernel to SIGKILL it
when its parent, torchrun's agent, dies (Linux's PR_SET_PDEATHSIG). Its children follow on
their own: reward workers exit once their parent is gone (rewards.sandbox), the resource tracker
when its last user has.

Outside torchrun nothing changes: a job started by a shell must survive that shell (nohup).
"""

from __future__ import annotations

import ctypes
import os
import signal
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

"""Save-and-exit on a signal: how a run survives SLURM preemption and time limits.

SLURM (`#SBATCH --signal=USR1@120`) signals every task some time before it stops a job. A rank
must not save from inside the signal handler (it may be in the middle of a collective), and the
ranks of one job receive the signal at slightly different moments. So the handler only raises a
flag; after each step every rank takes part in one all-reduce (MAX) of the flag, and all of them
save and stop together. `mcore-rl train` then exits with PREEMPTED_EXIT_CODE, which the sbatch
scripts answer with `scontrol requeue`; the requeued job resumes from that checkpoint.

SLURM signals every process of a step, the reward workers and vLLM's engine process included, and
a signal's default action ends them. Ignoring the signal is inherited across fork and exec, so
the trainer ignores it before it starts any child process and installs its handler afterwards.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

from mcore_rl.config.trainer import signal_from_name
from mcore_rl.runtime.devices import collective_device

PREEMPTED_EXIT_CODE = 75
"""`mcore-rl train`'s exit status after a save requested by the signal (EX_TEMPFAIL)."""


class PreemptionFlag:
    """Raised by a signal on any rank; read collectively after each step."""

    def __init__(self, signal_name: str | None):
        self.signal = signal_from_name(signal_name) if signal_name else None
        self.raised = False
        if self.signal is not None:
            signal.signal(self.signal, signal.SIG_IGN)

    def arm(self) -> None:
        """Start reacting to the signal (call after every child process has started)."""
        if self.signal is not None:
            signal.signal(self.signal, self._raise)

    def _raise(self, signum, frame) -> None:
        self.raised = True

    def raised_anywhere(self) -> bool:
        """Whether any rank got the signal (collective over the world when a signal is
        configured; every rank must call it at the same point)."""
        if self.signal is None:
            return False
        if not dist.is_initialized():
            return self.raised
        flag = torch.tensor([int(self.raised)], device=collective_device(None))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

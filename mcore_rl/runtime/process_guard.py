"""No process, shared-memory segment or temporary file outlives its job.

torchrun starts every rank in a session of its own, so killing torchrun - even its whole process
group with `kill -9 -PGID`, or a test's timeout killing it - leaves the ranks running (they keep
training, with nobody to supervise or restart them). SLURM kills a job's whole cgroup; a
workstation or a CI machine has nothing that does. So a rank started by torchrun's agent (or
another launcher built on it: `accelerate launch`) asks the kernel to SIGKILL it when its parent
dies (Linux's PR_SET_PDEATHSIG, `exit_with_launcher`), and exits at once if the launcher is
already gone. Outside torchrun nothing changes there: a job started by a shell must survive that
shell (nohup).

A rank killed without cleanup (SIGKILL, the OOM killer, torchrun's death) leaves what it started:
child processes (Megatron's checkpoint writers and their Manager, reward workers, library
helpers), shared-memory segments (vLLM's CPU communicator names them the same in every job, so
the next job cannot start) and temporary files. `guard_this_rank` gives every rank a private
temporary folder (its TMPDIR) and a guard process (`rank_guard.py`) that removes all of it once
the rank is gone, however it went. `reclaim_stale_files` removes what a run from before these
guards, or one whose guard was killed too, left behind, and says so.

A rank's helpers must also survive the signals meant for the rank: a multiprocessing Manager dies
of SIGUSR1, which SLURM's `--signal` sends to every process of a step to trigger the preemption
save, the save that needs it. So a rank starts such helpers inside `helper_processes_guarded`,
with the signals it handles itself blocked (the mask is inherited).
"""

from __future__ import annotations

import contextlib
import ctypes
import getpass
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from . import rank_guard

PR_SET_PDEATHSIG = 1
LAUNCHED_BY_TORCHRUN = "TORCHELASTIC_RUN_ID"
"""An environment variable torchrun sets for every rank it starts."""

TEMP_PREFIX = "mcore_rl-rank-"
"""Private temporary folders: <system temp dir>/mcore_rl-rank-<pid>-<start time>-<random>."""

_TEMP_NAME = re.compile(rf"^{TEMP_PREFIX}(\d+)-(\d+)-")
_STALE_SEGMENT = re.compile(r"cpushm_\d+$")
"""vLLM's CPU communicator segments (`<job>-tp:0-[0-1]-cpushm_<rank>`)."""

_guard: subprocess.Popen | None = None


def _outside_private_folders(path: str) -> str:
    """`path` with every trailing private folder of a rank left out: a process started by a
    guarded one inherits its TMPDIR, and nesting private folders would lengthen the paths
    libraries make sockets under past the 107 bytes a Unix socket's name may have (vLLM's ZMQ
    sockets: <TMPDIR>/<uuid>)."""
    while _TEMP_NAME.match(os.path.basename(path)):
        path = os.path.dirname(path)
    return path


_system_temp_dir = _outside_private_folders(tempfile.gettempdir())
"""Where private folders are made: the system's temporary directory (this process's TMPDIR,
or the one its private folder lies in)."""


def system_temp_dir() -> str:
    """The machine's temporary directory, where private folders are made (outside them)."""
    return _system_temp_dir


def exit_with_launcher() -> bool:
    """Under torchrun on Linux (TORCHELASTIC_RUN_ID set): be killed when this process's parent
    dies, or exit now, with one line on stderr, if the launcher is already gone. Call first
    thing, before the imports. Returns whether the guard is set.

    The parent is torchrun's agent, or whatever runs between it and the rank: a wrapper
    (`torchrun --no-python bash wrapper.sh`, `nsys profile`, `py-spy record`), or an in-process
    launcher (`accelerate launch`). Under a wrapper the signal follows the wrapper, so a wrapper
    that should end with torchrun ends its script with `exec`. A launcher killed while its rank
    was still starting leaves the rank to init or a subreaper (systemd --user, tini), or its
    wrapper to them: the rank exits when no process from its parent up to PID 1 is a launcher
    (`launcher_gone`), and only then. A launcher may be PID 1 itself (torchrun as a container's
    entry point): its ranks' parent is PID 1, and they run."""
    if LAUNCHED_BY_TORCHRUN not in os.environ or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return False
    ancestors = _ancestors(os.getppid())
    if launcher_gone(ancestors):
        found = " <- ".join(f"pid {process.pid} `{' '.join(process.argv)[:100] or '?'}`"
                            for process in ancestors)
        print(f"mcore_rl: error: this rank (pid {os.getpid()}) was started by torchrun or a "
              f"launcher like it ({LAUNCHED_BY_TORCHRUN} is set), but none runs above it any "
              f"more: expected torchrun, torch.distributed.run, accelerate or another process "
              f"running torch among its parent and the parent's ancestors, found {found}; "
              f"exiting rather than running unsupervised", file=sys.stderr, flush=True)
        os._exit(1)
    return True


LAUNCHER_PROGRAMS = ("torchrun", "accelerate")
"""Programs that start ranks (`torchrun`, `accelerate launch`), as a command's first word or
the script a Python runs; `python -m torch.distributed.run` (or `.launch`) is one too."""


@dataclass(frozen=True)
class Ancestor:
    """A process above this one, as /proc shows it."""

    pid: int
    argv: tuple[str, ...]
    """Its command line (empty where it cannot be read)."""

    runs_torch: bool
    """Whether it has torch's library loaded (every torch launcher has: its agent is Python
    code); False where its memory map cannot be read (another user's process, never a
    launcher of this one)."""

    @property
    def is_launcher(self) -> bool:
        """Its command is a launcher's (see LAUNCHER_PROGRAMS), or it runs torch."""
        programs = [os.path.basename(word) for word in self.argv[:2]]
        return (self.runs_torch or any(program in LAUNCHER_PROGRAMS for program in programs)
                or any(word.startswith("torch.distributed.") for word in self.argv))


def launcher_gone(ancestors: list[Ancestor]) -> bool:
    """Whether a rank started by a launcher has lost it, given its ancestors from its parent
    up to PID 1: none of them is a launcher. Not when nothing could be read: only positive
    evidence ends a rank."""
    return bool(ancestors) and not any(process.is_launcher for process in ancestors)


def _ancestors(pid: int) -> list[Ancestor]:
    """Process `pid` and its ancestors up to PID 1 (fewer when one is gone or hidden)."""
    chain = []
    while pid > 0 and len(chain) < 64:
        try:
            with open(f"/proc/{pid}/stat", "rb") as handle:
                parent = int(handle.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
        process = Ancestor(pid, _argv(pid), False)
        if not process.is_launcher and _runs_torch(pid):
            process = Ancestor(pid, process.argv, True)
        chain.append(process)
        pid = parent
    return chain


def _argv(pid: int) -> tuple[str, ...]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            words = handle.read().decode(errors="replace").split("\0")
    except OSError:
        return ()
    return tuple(words[:-1] if words and words[-1] == "" else words)


def _runs_torch(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps", "rb") as handle:
            return any(b"/libtorch" in line for line in handle)
    except OSError:
        return False


def guard_this_rank() -> str | None:
    """Give this process a private temporary folder (TMPDIR, for it and every process it
    starts) and a guard that, once this process is gone, kills what it started, unlinks the
    shared memory they used and removes the folder. Idempotent; Linux only (elsewhere nothing
    happens and None is returned). Call from the main thread, before starting helpers or
    engines. Returns the temporary folder."""
    global _guard
    if _guard is not None:
        return os.environ["TMPDIR"]
    if not (sys.platform.startswith("linux") and hasattr(os, "pidfd_open")):
        return None
    pid = os.getpid()
    temp_dir = tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{pid}-{rank_guard.start_time(pid)}-",
                                dir=_system_temp_dir)
    whole_session = LAUNCHED_BY_TORCHRUN in os.environ and os.getsid(0) == pid
    _guard = subprocess.Popen([sys.executable, "-I", "-S", rank_guard.__file__, str(pid),
                               temp_dir, "session" if whole_session else "own"],
                              stdin=subprocess.DEVNULL)
    _keep_caches_in(_system_temp_dir)
    os.environ["TMPDIR"] = temp_dir
    tempfile.tempdir = temp_dir
    return temp_dir


CACHES_UNDER_TMPDIR = {"TORCHINDUCTOR_CACHE_DIR": "torchinductor_{user}"}
"""Caches that libraries keep under the temporary directory by default, meant to outlive a run
(torch.compile's kernels: vLLM compiles some at every engine start). A private TMPDIR would
make each rank start cold (+50% on tests/test_rl_resume.py), so they stay where they were."""


def _keep_caches_in(temp_dir: str) -> None:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    user = re.sub(r"[\\/:*?\"<>|]", "_", user)  # as torch names its folder
    for variable, folder in CACHES_UNDER_TMPDIR.items():
        os.environ.setdefault(variable, os.path.join(temp_dir, folder.format(user=user)))


def reclaim_stale_files() -> list[str]:
    """Remove what killed runs left on this machine and nobody uses: vLLM CPU communicator
    segments in /dev/shm that no live process maps or holds open, and private temporary folders
    of ranks that are gone. Segments of a live job are never touched. Returns the names
    removed (the caller says so)."""
    if not sys.platform.startswith("linux"):
        return []
    removed = []
    try:
        candidates = {name for name in os.listdir(rank_guard.SHM_DIR)
                      if _STALE_SEGMENT.search(name)}
    except OSError:
        candidates = set()
    if candidates:
        unlinked, _ = rank_guard.unlink_unheld(candidates)
        removed += [os.path.join(rank_guard.SHM_DIR, name) for name in unlinked]
    for name in os.listdir(_system_temp_dir):
        match = _TEMP_NAME.match(name)
        if match and rank_guard.start_time(int(match.group(1))) != int(match.group(2)):
            shutil.rmtree(os.path.join(_system_temp_dir, name), ignore_errors=True)
            removed.append(os.path.join(_system_temp_dir, name))
    return removed


@contextlib.contextmanager
def helper_processes_guarded():
    """For a block that may start helper processes (Megatron's checkpoint writer starts its
    Manager in the first save). They start with the signals this process handles itself
    blocked, so that a signal sent to every process of a job step (SLURM's `--signal=USR1`, the
    preemption save's trigger) does not kill them in the middle of that save; this process
    still gets those signals. (That they die with this process is `guard_this_rank`'s part.)"""
    handled = [number for number in signal.valid_signals()
               if callable(signal.getsignal(number))]
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, handled)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)

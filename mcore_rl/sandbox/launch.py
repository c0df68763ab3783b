"""The rank starting and stopping its zygote process (zygote.py): the private directory, the
control socket, the command line and environment it starts with, and its end.

Why this module exists
----------------------
What the zygote process is handed at start (the rank's import path, its limits, the folders of
the user's code, only the environment variables BASIC_ENVIRONMENT and the limits name) and how
it is stopped even when a `Sandbox` is never closed (a finalizer holds `_Processes`, not the
Sandbox) is one concern, apart from the sessions' bookkeeping in client.py. Like the rest of
the package it imports no torch and no mcore_rl.runtime at module level: the zygote imports
this package.
"""

from __future__ import annotations

import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Optional

from .channel import _Channel
from .limits import BASIC_ENVIRONMENT, SandboxLimits
from .user_code import code_folders
from .zygote import ZYGOTE_BOOT

STOP_GRACE_SECONDS = 2.0
"""How long a stopping zygote gets to end its sessions and exit before it is killed."""


class _Processes:
    """The zygote and the session channels: what must be stopped even when the Sandbox object is
    never closed (the finalizer holds this, not the Sandbox)."""

    def __init__(self):
        self.zygote: Optional[subprocess.Popen] = None
        self.control: Optional[Connection] = None
        self.directory: Optional[str] = None
        self.channels: dict[int, _Channel] = {}

    def stop(self) -> None:
        """Stop the zygote (it kills every session), close every channel, remove the private
        directory. Idempotent."""
        if self.zygote is not None:
            try:
                self.control.send(("stop",))
            except OSError:
                pass
            try:
                self.zygote.wait(timeout=STOP_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                self.zygote.kill()  # its sessions die with it (PDEATHSIG)
                self.zygote.wait()
            self.control.close()
            self.zygote = None
        for channel in self.channels.values():
            channel.close()
        self.channels.clear()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None


def spawn_zygote(processes: _Processes, limits: SandboxLimits, sandbox_name: str,
                 preload: tuple, main_objects: bytes) -> None:
    """Start the zygote process in a new private directory, recorded in `processes` (its
    control connection included); it confines itself and then reports "ready" or "failed"."""
    # Not under the rank's own TMPDIR, which only root may enter: in the system's temporary
    # directory, named like a rank's private folder so that the next job removes it if
    # both the rank and the zygote were killed (process_guard.reclaim_stale_files).
    # Imported here: the zygote imports this module, and mcore_rl.runtime imports torch.
    from ..runtime.process_guard import TEMP_PREFIX, system_temp_dir
    from ..runtime.rank_guard import start_time

    pid = os.getpid()
    directory = tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{pid}-{start_time(pid)}-{sandbox_name}-",
                                 dir=system_temp_dir())
    processes.directory = directory
    ours, theirs = socket.socketpair()
    # the zygote's cwd differs: `readable` and the import path as the rank resolves them
    limits = replace(limits, readable=tuple(os.path.abspath(place) for place in limits.readable))
    setup = {"control_fd": theirs.fileno(), "directory": directory, "limits": limits,
             "preload": preload, "code_folders": code_folders(), "main_objects": main_objects}
    path = [os.path.abspath(entry) for entry in sys.path]
    processes.zygote = subprocess.Popen(
        [sys.executable, "-c", ZYGOTE_BOOT, pickle.dumps(path).hex(), pickle.dumps(setup).hex()],
        stdin=subprocess.DEVNULL, pass_fds=[theirs.fileno()],
        env={name: os.environ[name] for name in (*BASIC_ENVIRONMENT, *limits.environment)
             if name in os.environ})
    theirs.close()
    processes.control = Connection(ours.detach())

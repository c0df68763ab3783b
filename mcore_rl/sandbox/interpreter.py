"""A fresh Python interpreter for model-written code, reachable from a confined session.

The python tool runs model code in a fresh interpreter, not in a fork of the session: the
session's process holds the episode (its environment object, the dataset row, the ground truth),
and a fork hands all of it to the code (`gc.get_objects()`). In the sandbox the zygote has become
`nobody`, for whom a Python under /root is out of reach by its path, so the zygote opens the
interpreter's binary and its home (sys.base_prefix) before (`open_interpreter`), and the fresh
interpreter is exec'd through /proc/self/fd/N, with PYTHONHOME on its home's descriptor and the
session's import path: the kernel follows those links without checking the path above them.
"""

from __future__ import annotations

import os
import sys

OPENED = "MCORE_RL_SANDBOX_PYTHON"
"""Where the zygote leaves the two descriptors (`<binary>:<home>`) for its sessions."""

_PROC_FD = "/proc/self/fd/"


def open_interpreter() -> None:
    """In the zygote, before it drops its user: open this interpreter's binary and home."""
    binary = os.open(os.path.realpath(sys.executable), os.O_PATH)
    home = os.open(sys.base_prefix, os.O_PATH | os.O_DIRECTORY)
    os.environ[OPENED] = f"{binary}:{home}"


def fresh_interpreter(environment: dict[str, str]) -> tuple[str, dict[str, str], set[int]]:
    """(the binary to exec, `environment` plus the variables that find the standard library and
    this process's import path, the descriptors the new image must keep open for them)."""
    path = [entry for entry in sys.path if entry and os.path.isdir(entry)]
    keep = {int(entry[len(_PROC_FD):]) for entry in path if entry.startswith(_PROC_FD)}
    environment = dict(environment, PYTHONPATH=os.pathsep.join(path))
    if OPENED not in os.environ:  # outside the sandbox: the interpreter is reachable
        return sys.executable, environment, keep
    binary, home = map(int, os.environ[OPENED].split(":"))
    environment["PYTHONHOME"] = f"{_PROC_FD}{home}"
    return f"{_PROC_FD}{binary}", environment, keep | {binary, home}

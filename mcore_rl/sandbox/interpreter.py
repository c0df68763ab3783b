"""A fresh Python interpreter for model-written code, reachable from a confined session, in a
Landlock domain of its own.

The python tool runs model code in a fresh interpreter, not in a fork of the session: the
session's process holds the episode (its environment object, the dataset row, the ground truth),
and a fork hands all of it to the code (`gc.get_objects()`). In the sandbox the zygote has become
`nobody`, for whom a Python under /root is out of reach by its path, so the zygote opens the
interpreter's binary and its home (sys.base_prefix) before (`open_interpreter`), and the fresh
interpreter is exec'd through /proc/self/fd/N, with PYTHONHOME on its home's descriptor and the
import path's entries that lie in the Python installation: the kernel follows those links
without checking the path above them.

The session may read more than the model's code should: `readable` is what the environment
opens (its dataset: the answers), and the user's code folders are the environment's. So before
its exec the interpreter's process adds a Landlock layer of its own (`confine_interpreter`;
layers stack, a process can only restrict itself further): reads only in the Python
installation (its standard library and site-packages), the system's library folders (/usr,
/lib*: the loader, libc, locales), the loader's cache and the time zone, /dev/null and the
random devices, its own /proc/<pid> and the session's directory, which is also the only place
it writes. Not /proc as a whole: another process's command line and status are there, nor /sys,
nor the rest of /etc. A file of `readable` inside one of those folders stays readable: keep a
dataset out of the Python installation and /usr.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

from .kernel import LANDLOCK_READ_RIGHTS, READ_FILE, read_rights, restrict_files
from .user_code import beneath

OPENED = "MCORE_RL_SANDBOX_PYTHON"
"""Where the zygote leaves the two descriptors (`<binary>:<home>`) for its sessions."""

_PROC_FD = "/proc/self/fd/"

INTERPRETER_SYSTEM_READABLE = ("/usr", "/lib", "/lib64", "/lib32", "/etc/ld.so.cache",
                               "/etc/localtime", "/dev/null", "/dev/zero", "/dev/random",
                               "/dev/urandom")
"""What a fresh interpreter reads outside the Python installation: shared libraries and the
loader's cache, locales (/usr/lib/locale), the time zone, the devices Python and its libraries
open."""

_readable: list[tuple[int, int]] = []
"""(descriptor, Landlock read rights) of what a fresh interpreter may read, opened by the zygote
(`open_interpreter`) while its user could still reach them; sessions inherit them."""

_installation: list[str] = []
"""The Python installation's folders (real paths): the import path's entries beneath them are
the fresh interpreter's."""

_session: Optional[tuple[str, int]] = None
"""In a session confined by Landlock: (its directory, the Landlock ABI); else None."""


def open_interpreter() -> None:
    """In the zygote, before it drops its user: open this interpreter's binary and home, and
    what a fresh interpreter may read."""
    binary = os.open(os.path.realpath(sys.executable), os.O_PATH)
    home = os.open(sys.base_prefix, os.O_PATH | os.O_DIRECTORY)
    os.environ[OPENED] = f"{binary}:{home}"
    _installation[:] = sorted({os.path.realpath(prefix) for prefix in (
        sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)})
    places = [path for path in (*_installation, *INTERPRETER_SYSTEM_READABLE)
              if os.path.exists(path)]
    _readable[:] = [(binary, READ_FILE),
                    *((os.open(path, os.O_PATH), read_rights(path)) for path in places)]


def enter_session(directory: str, landlock: int) -> None:
    """In a session, once it is confined: its directory and Landlock ABI (0: none, where the
    sandbox runs unconfined), for `confine_interpreter`."""
    global _session
    _session = (directory, landlock) if landlock and OPENED in os.environ else None


def fresh_interpreter(environment: dict[str, str]) -> tuple[str, dict[str, str], set[int]]:
    """(the binary to exec, `environment` plus the variables that find the standard library and
    the import path, the descriptors the new image must keep open for them). In a Landlock
    session the import path keeps only the Python installation's entries (site-packages): the
    rest (the user's code) is out of the interpreter's reach (`confine_interpreter`)."""
    path = [entry for entry in sys.path if entry and os.path.isdir(entry)]
    if _session is not None:
        path = [entry for entry in path if any(beneath(os.path.realpath(entry), root)
                                               for root in _installation)]
    keep = {int(entry[len(_PROC_FD):]) for entry in path if entry.startswith(_PROC_FD)}
    environment = dict(environment, PYTHONPATH=os.pathsep.join(path))
    if OPENED not in os.environ:  # outside the sandbox: the interpreter is reachable
        return sys.executable, environment, keep
    binary, home = map(int, os.environ[OPENED].split(":"))
    environment["PYTHONHOME"] = f"{_PROC_FD}{home}"
    return f"{_PROC_FD}{binary}", environment, keep | {binary, home}


def confine_interpreter() -> None:
    """In the process about to exec a fresh interpreter, in a Landlock session, before it
    closes the descriptors it inherited: add the interpreter's own Landlock layer (the module
    docstring). Nothing outside a session or where the sandbox runs unconfined. Raises when
    the layer cannot be added: the code must not run with the session's reads."""
    if _session is None:
        return
    directory, abi = _session
    own = os.open("/proc/self", os.O_PATH | os.O_DIRECTORY)  # /proc/<this pid>, kept by exec
    try:
        restrict_files(directory, [*_readable, (own, LANDLOCK_READ_RIGHTS)], abi,
                       deny_tcp=False)  # the session's layer denies TCP already
    finally:
        os.close(own)

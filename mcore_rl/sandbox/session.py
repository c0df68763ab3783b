"""A session's process, forked by the zygote: its confinement, then its requests.

An environment is a user object holding an episode's state, so a session's requests run where
that object lives, one at a time (the factory's call, then one reply per request), and a hang
or a crash costs only its own session.

Each session, after its fork: a process group of its own (a timeout kills the group), a user
namespace of its own (RLIMIT_NPROC counts processes per user namespace, so each session's limit
counts its own processes only, though all run as the same uid), no capabilities, then Landlock
(after the user namespace, whose uid_map it could not write otherwise): writes only beneath its
own subdirectory, reads only there and in the system's folders, the Python installation and the
code on the import path (zygote_confinement._open_readable), TCP bind/connect denied when
network is off, no signal, ptrace or abstract Unix socket reaching outside the session; a
seccomp filter that fails io_uring (whose operations open sockets past the socket(2) rule) and,
with network off, every socket(2) (UDP and the host's Unix sockets too); rlimits (address
space, file size, processes, CPU time per call, no core files); PDEATHSIG. The python tool's
fresh interpreters add a Landlock layer of their own below it (interpreter.py): the session's
`readable` and the user's code are the environment's, not the model's.
"""

from __future__ import annotations

import importlib
import math
import os
import resource
import tempfile
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

from .channel import MAX_MESSAGE_BYTES, load_plain_data
from .errors import describe_exception
from .interpreter import enter_session
from .kernel import (PR_SET_DUMPABLE, _check, _libc, drop_capabilities, enter_user_namespace,
                     filter_system_calls, restrict_files, set_parent_death_signal)
from .limits import SandboxLimits


@dataclass
class _Confinement:
    """What the zygote achieved, which its sessions build on."""

    mechanisms: dict
    own_user_namespaces: bool
    """Sessions can enter user namespaces of their own (exact per-session RLIMIT_NPROC)."""

    landlock: int
    """Landlock ABI (0: none, where allow_unconfined allows it)."""

    deny_tcp: bool

    filter_calls: bool
    """The seccomp filter knows this machine: no session uses io_uring (kernel.py)."""

    deny_sockets: bool
    """Network off and the seccomp filter knows this machine: no session creates a socket."""

    readable: list
    """(descriptor, Landlock read rights) of what a session may read
    (zygote_confinement._open_readable)."""


def resolve(factory: str) -> Any:
    """The object a "package.module:attribute.path" string names (imported here)."""
    module_name, separator, attribute_path = factory.partition(":")
    if not separator or not module_name or not attribute_path:
        raise ValueError(f"session factory {factory!r} is not like package.module:attribute")
    target = importlib.import_module(module_name)
    for attribute in attribute_path.split("."):
        target = getattr(target, attribute)
    return target


def _run_session(channel: Connection, directory: str, limits: SandboxLimits,
                 confinement: _Confinement, process_limit: int) -> None:
    """A forked session: confine it, then serve its requests; never returns."""
    status = 1
    try:
        try:
            _confine_session(directory, limits, confinement, process_limit)
        except Exception as error:
            _send_outcome(channel, (False, None, "the session cannot be confined: "
                                    f"{describe_exception(error)}"))
            return
        _serve_session(channel, limits)
        status = 0
    finally:
        os._exit(status)


def _confine_session(directory: str, limits: SandboxLimits, confinement: _Confinement,
                     process_limit: int) -> None:
    os.setpgid(0, 0)
    if confinement.own_user_namespaces:
        # /proc/self/*_map belong to root while the process is undumpable (as the zygote is)
        _check(_libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
        enter_user_namespace()
        drop_capabilities()
    if confinement.landlock:
        restrict_files(directory, confinement.readable, confinement.landlock,
                       confinement.deny_tcp)
    enter_session(directory, confinement.landlock)
    if confinement.filter_calls:
        filter_system_calls(confinement.deny_sockets)
    _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
    os.chdir(directory)
    os.environ.update(HOME=directory, TMPDIR=directory)
    tempfile.tempdir = directory
    for limit, value in ((resource.RLIMIT_AS, limits.memory_mb << 20),
                         (resource.RLIMIT_FSIZE, limits.max_file_mb << 20),
                         (resource.RLIMIT_NPROC, process_limit), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(limit, (value, value))
    set_parent_death_signal()


def _serve_session(channel: Connection, limits: SandboxLimits) -> None:
    """The session's loop: the factory's call, then one reply per request, until EOF."""
    handler = None
    while True:
        try:
            message = channel.recv_bytes()
        except EOFError:
            return
        _limit_cpu_for_one_call(limits.cpu_seconds)
        try:
            if handler is None:
                factory, argument = ForkingPickler.loads(message)
                handler = resolve(factory)(argument)
                outcome = (True, os.getpid(), "")
            else:
                outcome = (True, handler(ForkingPickler.loads(message)), "")
        except Exception as error:
            outcome = (False, None, describe_exception(error))
        _send_outcome(channel, outcome)
        if handler is None:  # the factory failed: the session ends
            return


def _limit_cpu_for_one_call(seconds: float) -> None:
    """RLIMIT_CPU's soft limit: the CPU time used so far plus `seconds` (rounded up: the limit
    counts whole seconds)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = math.ceil(usage.ru_utime + usage.ru_stime + seconds)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.getrlimit(resource.RLIMIT_CPU)[1]))


def _send_outcome(channel: Connection, outcome: tuple) -> None:
    """Send (ok, value, error); a value that is not plain data (see load_plain_data) becomes an
    error."""
    try:
        message = ForkingPickler.dumps(outcome)
        load_plain_data(message)
        if len(message) > MAX_MESSAGE_BYTES:
            raise ValueError(f"{len(message)} bytes, more than {MAX_MESSAGE_BYTES}")
    except Exception as error:
        message = ForkingPickler.dumps((False, None, "the reply cannot be sent back (only plain "
                                        f"data can): {describe_exception(error)}"))
    channel.send_bytes(message)

"""Sandboxed sessions for agent environments and tools: one confined process per session.

In multi-turn agentic RL the model's output becomes input to code - tool arguments, Python it
wrote - and a user's environment runs next to it. That code may hang, allocate or fork without
bound, write wherever the trainer may, or open connections; none of it may stop training or
reach the machine. So it runs in processes the kernel confines. Python-level guards (audit hooks)
are no boundary - ctypes walks around them - and none is used.

One process per session: an environment is a user object holding an episode's state, so a
session's requests run where that object lives, one at a time, and a hang or a crash costs only
its own session (killed; the others go on). A rank keeps many sessions open (one per episode, e.g.
128), mostly idle. The rank has threads (torch, NCCL, vLLM), so it must not fork, and a fresh
interpreter per session costs ~100 times a fork. So the rank starts one "zygote" process once,
which confines itself and then forks each session (~1-2 ms). The zygote is started with
subprocess, not multiprocessing's spawn: spawn re-imports the trainer's `__main__` (torch
included) into the child, and so into every session's address space, which RLIMIT_AS counts.

The zygote, once, in this order (unshare(CLONE_NEWUSER) needs a single-threaded process, so the
zygote never starts a thread; it checks for its parent's death in its loop instead):
1. its private directory becomes its cwd, HOME and TMPDIR: made by the rank in the system's
   temporary directory (the rank's own TMPDIR is root's alone), removed by the zygote when it
   ends, or by the next job (it is named like a rank's private folder) when the zygote was
   killed too;
2. as root, it becomes `nobody`: root ignores RLIMIT_NPROC, and root's file permissions are the
   machine's. Directories on sys.path that nobody may not enter (a Python under /root) stay
   importable through descriptors opened before (`/proc/self/fd/N`);
3. unshare(CLONE_NEWUSER | CLONE_NEWNET): no network interface but a loopback that is down, so no
   TCP, UDP or abstract Unix socket reaches the host. Where user namespaces are blocked (Docker's
   default seccomp profile, Ubuntu's apparmor_restrict_unprivileged_userns) Landlock's TCP rules
   are the fallback (TCP only);
4. it becomes undumpable (no session may ptrace it), a child subreaper that kills every orphan
   reparented to it (a dead session's children), and sets PR_SET_PDEATHSIG(SIGTERM) after the
   setuid (which clears it): when the rank dies it kills its sessions, removes the directory and
   exits (it also checks every ORPHAN_CHECK_SECONDS whether the rank is still its parent).
Each session, after its fork: a process group of its own (a timeout kills the group), a user
namespace of its own (RLIMIT_NPROC counts processes per user namespace, so each session's limit
counts its own processes only, though all run as the same uid), no capabilities, then Landlock
(after the user namespace, whose uid_map it could not write otherwise): writes only beneath its
own subdirectory (reads: what the uid may read), TCP bind/connect denied when network is off,
no signal, ptrace or abstract Unix socket reaching outside the session; rlimits (address space,
file size, processes, CPU time per call, no core files); PDEATHSIG. What holds where a mechanism
is missing: `Sandbox.mechanisms()`.

The rank only ever unpickles plain data from a session (`load_plain_data`): code running in a
session must not be able to run code in the rank through a crafted pickle, nor stall it with
half a message (the rank reads sessions without blocking).

Reused by the python tool (python_tool.py): `set_parent_death_signal`, `describe_status`.
Use a Sandbox from one thread, and start it (first `open`) from a thread that lives as long as
the rank: PR_SET_PDEATHSIG fires when the thread that started the zygote exits.
"""

from __future__ import annotations

import ctypes
import importlib
import io
import math
import os
import pickle
import resource
import shutil
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler, recv_handle, send_handle
from typing import Any, Optional

from ..rewards.types import describe_exception


@dataclass(frozen=True)
class SandboxLimits:
    """What one session may use."""

    timeout_seconds: float = 30.0
    """Wall clock per call (open or request); past it the session process is killed."""

    memory_mb: int = 1024
    """RLIMIT_AS of a session process (its address space, the forked interpreter included)."""

    cpu_seconds: float = 30.0
    """CPU seconds per call: RLIMIT_CPU's soft limit is set before each call to the CPU time used
    so far plus this (SIGXCPU ends the session). A soft limit the handler's code could raise
    again; the wall clock bounds every call regardless."""

    max_processes: int = 16
    """Processes a session may have running besides itself (RLIMIT_NPROC)."""

    max_file_mb: int = 64
    """Largest file a session may write (RLIMIT_FSIZE)."""

    network: bool = False
    """False: no network (a network namespace of its own; Landlock's TCP rules where user
    namespaces are blocked)."""

    def __post_init__(self):
        for name in ("timeout_seconds", "memory_mb", "cpu_seconds", "max_file_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name} must be positive, not "
                                 f"{getattr(self, name)}")
        if self.max_processes < 0:
            raise ValueError("SandboxLimits.max_processes must be 0 or more, not "
                             f"{self.max_processes}")


@dataclass(frozen=True)
class Reply:
    """The outcome of one call: opening a session or one request to it."""

    key: str
    """The session."""

    ok: bool
    """The call returned (False: it raised, timed out, or the session is gone)."""

    value: Any
    """What the handler returned (None for an open, and when not ok)."""

    error: str
    """"" when ok; else what went wrong, e.g. "timeout after 30.0 s", "ValueError: ...",
    "session ended"."""

    seconds: float
    """Wall time of the call, from when it was sent to the session."""

    ended: bool
    """The session process is gone after this reply (timeout, crash, closed)."""


def resolve(factory: str) -> Any:
    """The object a "package.module:attribute.path" string names (imported here)."""
    module_name, separator, attribute_path = factory.partition(":")
    if not separator or not module_name or not attribute_path:
        raise ValueError(f"session factory {factory!r} is not like package.module:attribute")
    target = importlib.import_module(module_name)
    for attribute in attribute_path.split("."):
        target = getattr(target, attribute)
    return target


# ----------------------------------------------------------------------------------------------
# Kernel calls (Linux, through libc; syscall numbers are the same on x86_64 and aarch64).

_libc = ctypes.CDLL(None, use_errno=True)

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
NOBODY = 65534

SYS_LANDLOCK_CREATE_RULESET = 444
SYS_LANDLOCK_ADD_RULE = 445
SYS_LANDLOCK_RESTRICT_SELF = 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
LANDLOCK_WRITE_RIGHTS_ABI1 = sum(1 << bit for bit in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12))
"""WRITE_FILE, REMOVE_DIR, REMOVE_FILE and MAKE_CHAR/DIR/REG/SOCK/FIFO/BLOCK/SYM."""
LANDLOCK_ACCESS_FS_REFER = 1 << 13  # ABI 2: links and renames across directories
LANDLOCK_ACCESS_FS_TRUNCATE = 1 << 14  # ABI 3
LANDLOCK_ACCESS_NET_TCP = (1 << 0) | (1 << 1)  # ABI 4: BIND_TCP, CONNECT_TCP
LANDLOCK_SCOPES = (1 << 0) | (1 << 1)  # ABI 6: ABSTRACT_UNIX_SOCKET, SIGNAL


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _CapabilityHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapabilityData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def _check(result: int, call: str) -> None:
    if result < 0:
        number = ctypes.get_errno()
        raise OSError(number, f"{call}: {os.strerror(number)}")


def set_parent_death_signal(number: int = signal.SIGKILL) -> None:
    """Get signal `number` when the parent dies; exit now if it already has (the parent may have
    died before the call)."""
    parent = os.getppid()
    _check(_libc.prctl(PR_SET_PDEATHSIG, number, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent or parent == 1:
        os._exit(1)


def enter_user_namespace(flags: int = 0) -> None:
    """unshare(CLONE_NEWUSER | flags), keeping the same uid and gid inside (a single-threaded
    process only)."""
    uid, gid = os.getuid(), os.getgid()
    _check(_libc.unshare(CLONE_NEWUSER | flags), "unshare(CLONE_NEWUSER)")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                       ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as handle:
            handle.write(text)


def drop_capabilities() -> None:
    """Give up every capability (those a new user namespace grants inside it)."""
    header = _CapabilityHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    _check(_libc.capset(ctypes.byref(header), (_CapabilityData * 2)()), "capset")


def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0: no Landlock)."""
    version = _libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0),
                            ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    return max(version, 0)


def restrict_writes_to(directory: str, abi: int, deny_tcp: bool) -> None:
    """Add a Landlock layer: file-system writes only beneath `directory`, TCP bind/connect
    denied (ABI >= 4, when `deny_tcp`), signals and abstract Unix sockets only within the layer
    (ABI >= 6). Layers stack; none is ever lifted."""
    write_rights = LANDLOCK_WRITE_RIGHTS_ABI1
    write_rights |= LANDLOCK_ACCESS_FS_REFER if abi >= 2 else 0
    write_rights |= LANDLOCK_ACCESS_FS_TRUNCATE if abi >= 3 else 0
    attr = _RulesetAttr(write_rights, LANDLOCK_ACCESS_NET_TCP if deny_tcp and abi >= 4 else 0,
                        LANDLOCK_SCOPES if abi >= 6 else 0)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8  # the fields this ABI knows
    ruleset = _libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr),
                            ctypes.c_size_t(size), ctypes.c_uint32(0))
    _check(ruleset, "landlock_create_ruleset")
    directory_fd = os.open(directory, os.O_PATH | os.O_DIRECTORY)
    try:
        rule = _PathBeneath(write_rights, directory_fd)
        _check(_libc.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH,
                             ctypes.byref(rule), 0), "landlock_add_rule")
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        _check(_libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0), "landlock_restrict_self")
    finally:
        os.close(directory_fd)
        os.close(ruleset)


def describe_status(status: int) -> str:
    """A wait status in words: "exit code 1", "killed by SIGXCPU (CPU time limit)"."""
    code = os.waitstatus_to_exitcode(status)
    if code >= 0:
        return f"exit code {code}"
    name = signal.Signals(-code).name
    reason = {signal.SIGXCPU: " (CPU time limit)", signal.SIGXFSZ: " (file size limit)"}
    return f"killed by {name}{reason.get(-code, '')}"


# ----------------------------------------------------------------------------------------------
# The zygote (its own process) and the sessions it forks.

ORPHAN_CHECK_SECONDS = 1.0
"""How often the zygote checks that the rank lives and kills orphans reparented to it."""

STOP_GRACE_SECONDS = 2.0
"""How long a stopping zygote gets to end its sessions and exit before it is killed."""

START_TIMEOUT_SECONDS = 60.0
"""How long the zygote may take to import and confine itself."""

EXIT_STATUS_WAIT_SECONDS = 0.5
"""How long a dead session's exit status (which the zygote reports) is awaited for its error."""

ZYGOTE_BOOT = ("import pickle, sys; sys.path[:] = pickle.loads(bytes.fromhex(sys.argv[1])); "
               "from mcore_rl.agents.sandbox import zygote_main; "
               "zygote_main(pickle.loads(bytes.fromhex(sys.argv[2])))")
"""The zygote's command line: the rank's import path first (the setup's pickle names classes of
this module), then the setup."""


@dataclass
class _Confinement:
    """What the zygote achieved, which its sessions build on."""

    mechanisms: dict
    own_user_namespaces: bool
    """Sessions can enter user namespaces of their own (exact per-session RLIMIT_NPROC)."""

    landlock: int
    """Landlock ABI (0: none)."""

    deny_tcp: bool


class _RankGone(Exception):
    """The zygote's parent, the rank, died."""


def zygote_main(setup: dict) -> None:
    """The zygote process: confine itself, report, fork sessions until told to stop or the
    rank dies, then end them all and remove the private directory."""
    control = Connection(setup["control_fd"])
    directory = setup["directory"]
    parent = os.getppid()

    def on_parent_death(*_):
        if os.getppid() != parent:  # not a SIGTERM sent to every process of a job
            raise _RankGone

    signal.signal(signal.SIGTERM, on_parent_death)
    zygote = None
    try:
        confinement = _confine_zygote(directory, setup["limits"])
        for module in setup["preload"]:  # confined already: their import-time code too
            importlib.import_module(module)
        _check_room_for_sessions(setup["limits"].memory_mb)
        control.send(("ready", confinement.mechanisms))
        zygote = _Zygote(control, parent, directory, setup["limits"], confinement)
        zygote.serve()
    except _RankGone:
        pass
    except Exception as error:
        control.send(("failed", describe_exception(error, limit=2000)))
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if zygote is not None:
            zygote.stop()
        shutil.rmtree(directory, ignore_errors=True)
        os._exit(0)


def _confine_zygote(directory: str, limits: SandboxLimits) -> _Confinement:
    """Steps 1-4 of the module docstring (Landlock is each session's: a layer here would forbid
    the sessions' writing their uid_map). Raises when the directory is out of the new user's
    reach, or network is off and nothing can deny it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the rank, which stops us
    os.chdir(directory)
    os.environ.update(HOME=directory, TMPDIR=directory)
    tempfile.tempdir = directory
    _check_room_for_sessions(limits.memory_mb)
    path_descriptors = {entry: os.open(entry, os.O_PATH | os.O_DIRECTORY)
                        for entry in sys.path if entry and os.path.isdir(entry)}
    user = _become_nobody(directory) if os.getuid() == 0 else _user_name(os.getuid())
    if not os.access(directory, os.W_OK | os.X_OK):
        raise RuntimeError(f"the sandbox directory {directory} is out of reach for {user}: a "
                           "folder above it is not searchable by others; point TMPDIR at one "
                           "that is (e.g. /tmp)")
    _keep_importable(path_descriptors)
    network, own_user_namespaces = _isolate_network(limits.network)
    abi = landlock_abi()
    deny_tcp = not limits.network and abi >= 4
    if network == "none" and not limits.network:
        if not deny_tcp:
            raise RuntimeError(
                "the tool sandbox cannot deny network access: user namespaces are unavailable "
                "(unshare(CLONE_NEWUSER | CLONE_NEWNET) failed) and Landlock's TCP rules need "
                f"Landlock ABI 4 (this kernel: {abi or 'no Landlock'}); allow network "
                "(SandboxLimits.network=True) or run where one of them works")
        network = "landlock"
    _check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")
    # no session (same uid) may ptrace the zygote, whose channel reaches the rank
    _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
    set_parent_death_signal(signal.SIGTERM)  # on_parent_death: end the sessions, clean up
    processes = ("none" if user == "root" else
                 "rlimit-nproc" if own_user_namespaces else "rlimit-nproc-shared")
    mechanisms = {"network": network, "filesystem": "landlock" if abi else "permissions",
                  "processes": processes, "user": user,
                  "signals": "landlock-scope" if abi >= 6 else "uid"}
    return _Confinement(mechanisms, own_user_namespaces, abi, deny_tcp)


HEAVY_MODULES = ("torch", "numpy", "vllm", "transformers")
"""Imports that make the zygote (and every session) large, named when it is too large."""


def _check_room_for_sessions(memory_mb: int) -> None:
    """Sessions inherit the zygote's address space, which their RLIMIT_AS counts: refuse to
    start when it leaves them no room (a heavy import on the way to this module)."""
    with open("/proc/self/status") as handle:
        size_kb = next(int(line.split()[1]) for line in handle if line.startswith("VmSize:"))
    if size_kb >> 10 >= memory_mb // 2:
        heavy = [name for name in HEAVY_MODULES if name in sys.modules] or ["none of them"]
        raise RuntimeError(
            f"the zygote already spans {size_kb >> 10} MB of address space, leaving sessions "
            f"too little of their memory_mb={memory_mb} (of {', '.join(HEAVY_MODULES)} it "
            f"imported: {', '.join(heavy)}); keep mcore_rl/agents/__init__.py light or raise "
            "memory_mb")


def _become_nobody(directory: str) -> str:
    """As root: become nobody (owner of `directory`); "root" where the uid cannot change."""
    try:
        os.chown(directory, NOBODY, NOBODY)
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    except OSError:
        return "root"
    # setuid made the process undumpable, which hands /proc/self/*_map to root
    _check(_libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
    return "nobody"


def _user_name(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _keep_importable(path_descriptors: dict[str, int]) -> None:
    """Replace the import paths this user may no longer enter - sys.path entries and the
    __path__ of packages imported already (their submodules load from there: encodings.idna) -
    by /proc/self/fd/N of a descriptor opened before: the kernel follows that link without
    checking the path above it."""
    replacements = {entry: f"/proc/self/fd/{descriptor}"
                    for entry, descriptor in path_descriptors.items()
                    if not os.access(entry, os.R_OK | os.X_OK)}
    if not replacements:
        return
    sys.path[:] = [replacements.get(entry, entry) for entry in sys.path]
    for module in list(sys.modules.values()):
        package_path = getattr(module, "__path__", None)
        if isinstance(package_path, list):
            package_path[:] = [_reachable(entry, replacements) for entry in package_path]
    sys.path_importer_cache.clear()


def _reachable(path: str, replacements: dict[str, str]) -> str:
    """`path` below a replaced entry, through that entry's replacement."""
    for entry, replacement in replacements.items():
        if path == entry or path.startswith(entry + os.sep):
            return replacement + path[len(entry):]
    return path


def _isolate_network(allow: bool) -> tuple[str, bool]:
    """A user and network namespace of the zygote's own (the network one only when `allow` is
    off). Returns (network mechanism, whether sessions can enter user namespaces)."""
    try:
        enter_user_namespace(0 if allow else CLONE_NEWNET)
    except OSError:
        return ("allowed" if allow else "none"), False
    drop_capabilities()
    return ("allowed" if allow else "netns"), True


class _Zygote:
    """The zygote's loop: fork sessions, kill them on request, reap them and report."""

    def __init__(self, control: Connection, parent: int, directory: str, limits: SandboxLimits,
                 confinement: _Confinement):
        self.control, self.parent, self.directory = control, parent, directory
        self.limits, self.confinement = limits, confinement
        self.sessions: dict[int, tuple[int, int]] = {}
        """Live sessions: serial -> (pid, pidfd)."""

    def serve(self) -> None:
        """Until the rank says stop or is gone."""
        while os.getppid() == self.parent:
            pidfds = [pidfd for _, pidfd in self.sessions.values()]
            ready = wait([self.control, *pidfds], timeout=ORPHAN_CHECK_SECONDS)
            self._reap()
            if self.control in ready and not self._obey():
                return

    def _obey(self) -> bool:
        """Carry out one message from the rank; False: stop."""
        try:
            message = self.control.recv()
        except (EOFError, OSError):
            return False
        if message[0] == "open":
            self._fork(message[1], recv_handle(self.control))
        elif message[0] == "kill":
            self._kill(message[1])
        return message[0] != "stop"

    def _fork(self, serial: int, channel_fd: int) -> None:
        directory = os.path.join(self.directory, f"session-{serial}")
        try:
            os.mkdir(directory)
        except OSError:  # the rank sees the channel close: "session process died"
            os.close(channel_fd)
            return
        process_limit = self._process_limit()
        try:
            pid = os.fork()
        except OSError:  # out of processes: the rank sees the channel close
            os.close(channel_fd)
            return
        if pid == 0:
            try:  # nothing may return into the zygote's loop in this process
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                self._close_inherited()
                _run_session(Connection(channel_fd), directory, self.limits, self.confinement,
                             process_limit)
            finally:
                os._exit(1)
        os.close(channel_fd)
        self.sessions[serial] = (pid, os.pidfd_open(pid))

    def _process_limit(self) -> int:
        """RLIMIT_NPROC for a new session. In a user namespace of its own only its processes
        count; otherwise every process of this uid does (an approximation: sessions opened
        earlier get less room as later ones start)."""
        own = self.limits.max_processes + 1
        return own if self.confinement.own_user_namespaces else own + _processes_of(os.getuid())

    def _close_inherited(self) -> None:
        """In a new session: let go of the zygote's channels to the rank and other sessions."""
        self.control.close()
        for _, pidfd in self.sessions.values():
            os.close(pidfd)

    def _kill(self, serial: int) -> None:
        if serial in self.sessions:
            _kill_group(self.sessions[serial][0])

    def _reap(self) -> None:
        """Report and clean up sessions that ended; kill orphans reparented to us."""
        for serial, (pid, pidfd) in list(self.sessions.items()):
            finished, status = os.waitpid(pid, os.WNOHANG)
            if not finished:
                continue
            _kill_group(pid)  # what the session left running
            os.close(pidfd)
            del self.sessions[serial]
            shutil.rmtree(os.path.join(self.directory, f"session-{serial}"), ignore_errors=True)
            self.control.send(("exited", serial, status))
        session_pids = {pid for pid, _ in self.sessions.values()}
        for orphan in _children() - session_pids:
            _kill_and_reap(orphan)

    def stop(self) -> None:
        """Kill every session, their groups and everything else below us."""
        for pid, _ in self.sessions.values():
            _kill_group(pid)
        for child in _children():
            _kill_and_reap(child)


def _kill_group(group: int) -> None:
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _kill_process(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _kill_and_reap(child: int) -> None:
    _kill_process(child)
    try:
        os.waitpid(child, 0)
    except ChildProcessError:
        pass


def _children() -> set[int]:
    """This process's live children (orphans reparented to a subreaper included)."""
    with open(f"/proc/self/task/{os.getpid()}/children") as handle:
        return {int(pid) for pid in handle.read().split()}


def _processes_of(uid: int) -> int:
    """How many processes belong to `uid` now."""
    count = 0
    for name in os.listdir("/proc"):
        try:
            count += name.isdigit() and os.stat(f"/proc/{name}").st_uid == uid
        except OSError:
            pass
    return count


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
        restrict_writes_to(directory, confinement.landlock, confinement.deny_tcp)
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


# ----------------------------------------------------------------------------------------------
# The rank's side.

MAX_MESSAGE_BYTES = 64 << 20
"""Largest reply a session may send; a larger one ends the session."""

SEND_TIMEOUT_SECONDS = 5.0
"""How long sending a request may block (a session that stops reading its channel is ended)."""


class _PlainDataUnpickler(pickle.Unpickler):
    """Loads only what pickles without naming a class or function (None, bool, int, float, str,
    bytes, list, tuple, dict, set): unpickling anything else runs code chosen by whoever wrote
    the bytes, and a session's bytes may have been written by the code it runs."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"{module}.{name} is not plain data")


def load_plain_data(message: bytes) -> Any:
    """Unpickle `message`, refusing anything but plain data (pickle.UnpicklingError)."""
    return _PlainDataUnpickler(io.BytesIO(message)).load()


class _Channel:
    """The rank's end of a session's socket. Messages are framed as multiprocessing's Connection
    frames them (4-byte big-endian length, then the bytes; the session uses a Connection), but
    are read without blocking, so a session that sends half a message cannot stall the rank."""

    def __init__(self, end: socket.socket):
        end.setblocking(False)
        self.socket = end
        self.received = bytearray()

    def fileno(self) -> int:
        return self.socket.fileno()

    def send(self, message: bytes) -> bool:
        """Send one message, blocking at most SEND_TIMEOUT_SECONDS; False: it could not."""
        pending = memoryview(struct.pack("!i", len(message)) + message)
        deadline = time.monotonic() + SEND_TIMEOUT_SECONDS
        while pending:
            try:
                pending = pending[self.socket.send(pending):]
            except BlockingIOError:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not select.select([], [self.socket], [], remaining)[1]:
                    return False
            except OSError:
                return False
        return True

    def receive(self) -> tuple[list[bytes], bool]:
        """(the complete messages that arrived, whether the session closed its end). Raises
        ValueError for a message over MAX_MESSAGE_BYTES."""
        closed = False
        while True:
            try:
                chunk = self.socket.recv(1 << 20)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                closed = True
                break
            self.received += chunk
        messages = []
        while len(self.received) >= 4:
            (size,) = struct.unpack("!i", self.received[:4])
            if not 0 <= size <= MAX_MESSAGE_BYTES:
                raise ValueError(f"a message of {size} bytes (at most {MAX_MESSAGE_BYTES})")
            if len(self.received) < 4 + size:
                break
            messages.append(bytes(self.received[4:4 + size]))
            del self.received[:4 + size]
        return messages, closed

    def close(self) -> None:
        self.socket.close()


@dataclass
class _Session:
    """The rank's view of one session."""

    key: str
    serial: int
    channel: _Channel
    pid: Optional[int] = None
    """The session process (known once it has opened)."""

    queued: deque = field(default_factory=deque)
    """Pickled requests not yet sent."""

    opening: bool = True
    """The open call is running (before its reply)."""

    sent_at: float = math.nan
    """time.monotonic() when the running call was sent (nan: idle)."""

    deadline: float = math.inf
    """time.monotonic() by which the running call must end."""

    @property
    def busy(self) -> bool:
        return self.deadline != math.inf


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


class Sandbox:
    """Sessions in confined processes forked from one zygote; non-blocking open/send, replies
    from poll(). See the module docstring for what confines them."""

    def __init__(self, limits: SandboxLimits, name: str = "tools", preload: tuple = ()):
        """preload: modules the zygote imports before forking any session, so that sessions
        start without importing them (the time counts against each call's timeout)."""
        self.limits = limits
        self.name = name
        self.preload = tuple(preload)
        self._processes = _Processes()
        self._finalizer = weakref.finalize(self, self._processes.stop)
        self._mechanisms: Optional[dict] = None
        self._sessions: dict[str, _Session] = {}
        self._by_serial: dict[int, _Session] = {}
        self._exit_statuses: dict[int, int] = {}
        """Exit statuses the zygote reported, by serial, until the session's end is handled."""
        self._ready: list[Reply] = []
        """Replies made without a session's answer (to an ended session, after a timeout)."""
        self._serials = 0

    def start(self) -> None:
        """Start and confine the zygote now (the first open does it otherwise). Raises when
        network is off and neither a network namespace nor Landlock can deny it."""
        if not self._finalizer.alive:
            raise RuntimeError(f"the {self.name} sandbox is shut down")
        if self._processes.zygote is not None:
            return
        # Not under the rank's own TMPDIR, which only root may enter: in the system's temporary
        # directory, named like a rank's private folder so that the next job removes it if
        # both the rank and the zygote were killed (process_guard.reclaim_stale_files).
        # Imported here: the zygote imports this module, and mcore_rl.runtime imports torch.
        from ..runtime.process_guard import TEMP_PREFIX, system_temp_dir
        from ..runtime.rank_guard import start_time

        pid = os.getpid()
        directory = tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{pid}-{start_time(pid)}-{self.name}-",
                                     dir=system_temp_dir())
        self._processes.directory = directory
        ours, theirs = socket.socketpair()
        setup = {"control_fd": theirs.fileno(), "directory": directory, "limits": self.limits,
                 "preload": self.preload}
        path = [os.path.abspath(entry) for entry in sys.path]  # the zygote's cwd differs
        self._processes.zygote = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE_BOOT, pickle.dumps(path).hex(),
             pickle.dumps(setup).hex()],
            stdin=subprocess.DEVNULL, pass_fds=[theirs.fileno()])
        theirs.close()
        self._processes.control = Connection(ours.detach())
        self._mechanisms = self._await_ready()

    def _await_ready(self) -> dict:
        control = self._processes.control
        if not control.poll(START_TIMEOUT_SECONDS):
            self.shutdown()
            raise RuntimeError(f"the {self.name} sandbox's zygote did not start within "
                               f"{START_TIMEOUT_SECONDS} s")
        try:
            kind, detail = control.recv()
        except EOFError:
            kind, detail = "failed", "the zygote process exited while starting"
        if kind != "ready":
            self.shutdown()
            raise RuntimeError(f"the {self.name} sandbox cannot start: {detail}")
        return detail

    def mechanisms(self) -> dict:
        """Which guarantees hold: {"network": "netns" | "landlock" (TCP only) | "allowed",
        "filesystem": "landlock" (writes only beneath the session's directory) | "permissions"
        (whatever the user may write), "processes": "rlimit-nproc" (per session) |
        "rlimit-nproc-shared" (one count for all sessions) | "none" (root), "user": "nobody" |
        "root" | the user's name, "signals": "landlock-scope" (no signal, ptrace or abstract
        Unix socket reaches outside the session) | "uid" (only uids keep sessions from
        signalling each other, and - when the rank is not root - the rank)}. Starts the zygote
        if needed."""
        self.start()
        return dict(self._mechanisms)

    def open(self, key: str, factory: str, argument: Any) -> None:
        """Start session `key`: in a new confined process, `handler = resolve(factory)(argument)`
        ("package.module:attribute", importable there). Non-blocking: its Reply (value None)
        comes from poll(); a factory that raises gives ok=False, ended=True."""
        if key in self._sessions:
            raise ValueError(f"session {key!r} is already open in the {self.name} sandbox")
        self.start()
        message = self._pickle(key, (factory, argument), ends_session=True)
        if message is None:
            return
        self._serials += 1
        ours, theirs = socket.socketpair()
        session = _Session(key, self._serials, _Channel(ours))
        self._sessions[key] = self._by_serial[session.serial] = session
        self._processes.channels[session.serial] = session.channel
        self._processes.control.send(("open", session.serial))
        send_handle(self._processes.control, theirs.fileno(), self._processes.zygote.pid)
        theirs.close()
        self._transmit(session, message)

    def send(self, key: str, request: Any) -> None:
        """Queue one request for session `key` (non-blocking; a session's requests run one at a
        time, in order). Its Reply carries handler(request); an exception from the handler is
        ok=False and the session goes on; past timeout_seconds the session is killed (ended).
        To an unknown or ended session: Reply(ok=False, error="session ended", ended=True)."""
        session = self._sessions.get(key)
        if session is None:
            self._ready.append(Reply(key, False, None, "session ended", 0.0, True))
            return
        message = self._pickle(key, request)
        if message is None:
            return
        session.queued.append(message)
        if not session.busy:
            self._transmit(session, session.queued.popleft())

    def poll(self, timeout: float = 0.0) -> list[Reply]:
        """The replies that arrived, waiting up to `timeout` seconds for one when none is ready;
        ends the sessions whose call ran past its deadline."""
        until = time.monotonic() + timeout
        while True:
            self._receive(until)
            self._expire()
            if self._ready or time.monotonic() >= until:
                replies, self._ready = self._ready, []
                return replies

    def close(self, key: str) -> None:
        """End session `key`'s process (no reply; queued requests are dropped)."""
        session = self._sessions.get(key)
        if session is not None:
            session.queued.clear()
            self._end(session)

    def shutdown(self) -> None:
        """End every process (zygote and sessions) and remove the private directory; also runs
        when the Sandbox is garbage-collected or the interpreter exits. Idempotent."""
        self._sessions.clear()
        self._by_serial.clear()
        self._finalizer()

    @property
    def directory(self) -> Optional[str]:
        """The private directory the sessions' directories lie in (None before start)."""
        return self._processes.directory

    def pids(self) -> dict[str, int]:
        """The process of each open session, by key (once it has opened), and "zygote"."""
        pids = {key: session.pid for key, session in self._sessions.items()
                if session.pid is not None}
        if self._processes.zygote is not None:
            pids["zygote"] = self._processes.zygote.pid
        return pids

    def _pickle(self, key: str, message: Any, ends_session: bool = False) -> Optional[bytes]:
        """The message's bytes; None (and a failed Reply) when it cannot be pickled."""
        try:
            return ForkingPickler.dumps(message)
        except Exception as error:
            self._ready.append(Reply(key, False, None, "the request cannot be sent to the "
                                     f"session: {describe_exception(error)}", 0.0, ends_session))
            return None

    def _transmit(self, session: _Session, message: bytes) -> None:
        session.sent_at = time.monotonic()
        session.deadline = session.sent_at + self.limits.timeout_seconds
        if not session.channel.send(message):
            self._ready.append(Reply(session.key, False, None, "session stopped reading its "
                                     "requests", time.monotonic() - session.sent_at, True))
            self._end(session)

    def _receive(self, until: float) -> None:
        """Wait until a message arrives, `until`, or the nearest call deadline; handle what
        arrived."""
        nearest = min((session.deadline for session in self._sessions.values()), default=until)
        timeout = 0.0 if self._ready else max(0.0, min(until, nearest) - time.monotonic())
        channels = {session.channel: session for session in self._sessions.values()}
        ready = wait([self._processes.control, *channels], timeout=timeout)
        if self._processes.control in ready:
            self._read_control()
        for channel in ready:
            session = channels.get(channel)
            if session is not None and self._sessions.get(session.key) is session:
                self._answer(session)

    def _read_control(self) -> None:
        """Note the exit statuses the zygote reported."""
        control = self._processes.control
        try:
            while control.poll():
                kind, *detail = control.recv()
                if kind == "failed":
                    raise RuntimeError(f"the {self.name} sandbox's zygote failed: {detail[0]}")
                serial, status = detail
                if serial in self._by_serial:
                    self._exit_statuses[serial] = status
        except (EOFError, OSError):
            raise RuntimeError(f"the {self.name} sandbox's zygote died "
                               f"(exit code {self._processes.zygote.poll()})") from None

    def _answer(self, session: _Session) -> None:
        """Turn what the session sent (or its end) into Replies; send its next request."""
        seconds = time.monotonic() - session.sent_at
        try:
            messages, closed = session.channel.receive()
            outcomes = [load_plain_data(message) for message in messages]
            if len(outcomes) > (1 if session.busy else 0):
                raise ValueError("a message it was not asked for")
        except (ValueError, pickle.UnpicklingError) as error:
            self._ready.append(Reply(session.key, False, None, "session ended: it broke the "
                                     f"protocol ({error})", seconds, True))
            self._end(session)
            return
        for ok, value, error in outcomes:
            self._reply(session, ok, value, error, seconds)
        if closed and session.key in self._sessions:
            self._died(session, seconds)

    def _reply(self, session: _Session, ok: bool, value: Any, error: str, seconds: float) -> None:
        ended = False
        if session.opening:  # the value is the session's pid; a failed open ends the session
            session.opening, ended = False, not ok
            session.pid, value = value, None
        self._ready.append(Reply(session.key, ok, value, error, seconds, ended))
        session.sent_at, session.deadline = math.nan, math.inf
        if ended:
            self._end(session)
        elif session.queued:
            self._transmit(session, session.queued.popleft())

    def _died(self, session: _Session, seconds: float) -> None:
        """The session's channel closed: its process is gone."""
        if session.busy:
            status = self._exit_status(session.serial)
            cause = describe_status(status) if status is not None else "no exit status"
            self._ready.append(Reply(session.key, False, None,
                                     f"session process died ({cause})", seconds, True))
        self._end(session)

    def _exit_status(self, serial: int) -> Optional[int]:
        deadline = time.monotonic() + EXIT_STATUS_WAIT_SECONDS
        while serial not in self._exit_statuses and time.monotonic() < deadline:
            if self._processes.control.poll(max(0.0, deadline - time.monotonic())):
                self._read_control()
        return self._exit_statuses.get(serial)

    def _expire(self) -> None:
        """Kill the sessions whose running call is past its deadline."""
        now = time.monotonic()
        for session in list(self._sessions.values()):
            if now >= session.deadline:
                self._ready.append(Reply(session.key, False, None,
                                         f"timeout after {self.limits.timeout_seconds} s",
                                         now - session.sent_at, True))
                self._end(session)

    def _end(self, session: _Session) -> None:
        """Kill the session's process group (if still running), forget it; its queued requests
        get "session ended"."""
        try:
            self._processes.control.send(("kill", session.serial))
        except OSError:
            pass
        session.channel.close()
        del self._processes.channels[session.serial]
        del self._sessions[session.key]
        del self._by_serial[session.serial]
        self._exit_statuses.pop(session.serial, None)
        self._ready.extend(Reply(session.key, False, None, "session ended", 0.0, True)
                           for _ in session.queued)

"""Steps 1-5 of zygote.py's docstring: the zygote confining itself once, before it forks any
session, and the checks that refuse to start a sandbox that would not hold.

Why this module exists
----------------------
What the zygote does to itself (its directory, its user, its namespaces, the descriptors that
keep the import path and `readable` reachable, the Landlock probe) decides what every session
inherits, and changes with the kernel mechanisms (kernel.py) and the machines they meet; the
fork loop and the reaping (zygote.py) do not. Nothing here imports more than the zygote did:
this module runs in the zygote, whose address space every session shares.
"""

from __future__ import annotations

import os
import platform
import signal
import sys
import tempfile

from .kernel import (CLONE_NEWNET, NOBODY, PR_SET_CHILD_SUBREAPER, PR_SET_DUMPABLE,
                     SIMULATE_NO_LANDLOCK, _check, _libc, can_filter_system_calls,
                     drop_capabilities, enter_user_namespace, landlock_abi, read_rights,
                     restrict_files, set_parent_death_signal)
from .interpreter import open_interpreter
from .limits import SandboxLimits
from .session import _Confinement
from .user_code import beneath


def out_of_reach_note(out_of_reach: list[str]) -> str:
    """Why the sandbox runs as root, and what to do."""
    return ("its sessions run as root, not as nobody, so no process limit holds and only "
            "Landlock keeps them from root's files: nobody could not read the user's code or "
            f"`readable` ({'; '.join(out_of_reach)}); make those folders readable and "
            "searchable by others (chmod o+rx, o+r for their files) or run the job as a "
            "non-root user")


def _confine_zygote(directory: str, limits: SandboxLimits, code_folders: list[str]
                    ) -> tuple[_Confinement, list[str], str]:
    """Steps 1-5 of the module docstring (Landlock is each session's: a layer here would forbid
    the sessions' writing their uid_map), what kept the zygote root (_closed_to_nobody), and why
    reads are unconfined ("" when Landlock confines them). Raises when the directory is out of
    the new user's reach, network is off and nothing can deny it, or Landlock does not work
    and allow_unconfined is off."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the rank, which stops us
    os.chdir(directory)
    os.environ.update(HOME=directory, TMPDIR=directory)
    tempfile.tempdir = directory
    _check_room_for_sessions(limits.memory_mb)
    path_descriptors = {entry: os.open(entry, os.O_PATH | os.O_DIRECTORY)
                        for entry in sys.path if entry and os.path.isdir(entry)}
    readable = _open_readable(limits.readable, code_folders)
    open_interpreter()  # the python tool's fresh interpreters
    out_of_reach = [] if os.getuid() else _closed_to_nobody((*limits.readable, *code_folders))
    user = _become_nobody(directory) if os.getuid() == 0 and not out_of_reach else \
        _user_name(os.getuid())
    if not os.access(directory, os.W_OK | os.X_OK):
        raise RuntimeError(f"the sandbox directory {directory} is out of reach for {user}: a "
                           "folder above it is not searchable by others; point TMPDIR at one "
                           "that is (e.g. /tmp)")
    _keep_importable(path_descriptors)
    network, own_user_namespaces = _isolate_network(limits.network)
    # mapping root into a session's namespace needs CAP_SETFCAP, which the zygote gave up
    own_user_namespaces &= user != "root"
    abi = landlock_abi()
    unconfined = _landlock_failure(directory, abi)
    if unconfined:
        if not limits.allow_unconfined:
            raise RuntimeError(
                f"Landlock does not work here ({unconfined}), and without it the sandbox cannot "
                "keep its processes from reading what their user may (checkpoints, home "
                "folders, other episodes' folders, the rank's temporary files); run on a kernel "
                "with Landlock (Linux >= 5.13 with landlock in its lsm= list, and a container "
                "runtime that does not filter the landlock_* calls), or, to run with reads "
                "limited by file permissions only, set allow_unconfined: true in this "
                "sandbox's settings (rollout.multi_turn.sandbox.allow_unconfined; "
                "SandboxLimits.allow_unconfined)")
        abi = 0
    deny_tcp = not limits.network and abi >= 4
    filter_calls = can_filter_system_calls()
    deny_sockets = not limits.network and filter_calls
    if network == "none" and not limits.network:
        if not (deny_tcp or deny_sockets):
            raise RuntimeError(
                "the sandbox cannot deny network access: user namespaces are unavailable "
                "(unshare(CLONE_NEWUSER | CLONE_NEWNET) failed), Landlock's TCP rules need "
                f"Landlock ABI 4 (this kernel: {abi or 'no Landlock'}) and the seccomp filter "
                f"does not know this machine ({platform.machine()}); allow network "
                "(SandboxLimits.network=True) or run where one of them works")
        network = "seccomp" if deny_sockets else "landlock"
    _check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")
    # no session (same uid) may ptrace the zygote, whose channel reaches the rank
    _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
    set_parent_death_signal(signal.SIGTERM)  # on_parent_death: end the sessions, clean up
    processes = ("none" if user == "root" else
                 "rlimit-nproc" if own_user_namespaces else "rlimit-nproc-shared")
    mechanisms = {"network": network,
                  "sockets": "seccomp" if deny_sockets else "allowed" if limits.network
                  else "namespaced",
                  "io_uring": "seccomp" if filter_calls else "allowed",
                  "filesystem": "landlock" if abi else "unconfined",
                  "processes": processes, "user": user,
                  "signals": "landlock-scope" if abi >= 6 else "uid"}
    return _Confinement(mechanisms, own_user_namespaces, abi, deny_tcp, filter_calls,
                        deny_sockets, list(readable.values())), out_of_reach, unconfined


def _landlock_failure(directory: str, abi: int) -> str:
    """Why Landlock cannot confine the sessions here, in words; "" when it can. A kernel may
    report an ABI and still refuse a layer (a container's seccomp profile filtering
    landlock_restrict_self), so a child adds one, as each session will, and exits."""
    if not abi:
        return (f"{SIMULATE_NO_LANDLOCK} is set" if os.environ.get(SIMULATE_NO_LANDLOCK) else
                "this kernel reports no Landlock ABI")
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            restrict_files(directory, [], abi, deny_tcp=False)
        except OSError as error:
            code = error.errno or 255
        except BaseException:
            code = 255
        finally:
            os._exit(code)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if code == 0:
        return ""
    reason = os.strerror(code) if 0 < code < 255 else f"exit code {code}"
    return f"adding a Landlock layer (ABI {abi}) failed: {reason}"


SYSTEM_READABLE = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc", "/dev", "/proc",
                   "/sys")
"""What programs read: libraries, configuration, devices (null, urandom), their own /proc."""


def _open_readable(extra: tuple[str, ...], code_folders: list[str]
                   ) -> dict[str, tuple[int, int]]:
    """Path -> (descriptor, Landlock read rights) of what sessions may read, opened before the
    user changes: the system's folders, the Python installation, `extra`, and where the user's
    code lives (user_code.code_folders: the import path's folders, editable packages), whole:
    a module may read the data beside it (model-written code reads none of them: the python
    tool's interpreter has a Landlock domain of its own, interpreter.py)."""
    roots = [*SYSTEM_READABLE, *{sys.prefix, sys.base_prefix, sys.exec_prefix,
                                 sys.base_exec_prefix}, *extra, *code_folders]
    targets = {os.path.realpath(root): read_rights(root) for root in roots if os.path.exists(root)}
    return {path: (os.open(path, os.O_PATH), rights) for path, rights in targets.items()}


def _closed_to_nobody(places: tuple[str, ...]) -> list[str]:
    """Those of `places` (the user's code and `readable`) that nobody, with no group but its
    own, could not reach by their paths: "place: what stops it (mode, owner uid)"."""
    closed = []
    for place in dict.fromkeys(os.path.realpath(place) for place in places):
        if not os.path.exists(place):
            continue
        steps = [(folder, 1) for folder in _folders_above(place)]  # 1: search, 4: read
        steps.append((place, 5 if os.path.isdir(place) else 4))
        for step, needed in steps:
            status = os.stat(step)
            bits = (status.st_mode >> 6 if status.st_uid == NOBODY else
                    status.st_mode >> 3 if status.st_gid == NOBODY else status.st_mode) & 7
            if bits & needed != needed:
                closed.append(f"{place}: {step} (mode {status.st_mode & 0o777:o}, owner uid "
                              f"{status.st_uid})")
                break
    return closed


def _folders_above(path: str) -> list[str]:
    """"/", "/a", "/a/b" for "/a/b/c"."""
    parts = path.split(os.sep)[1:-1]
    return [os.sep + os.sep.join(parts[:count]) for count in range(len(parts) + 1)]


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
            f"imported: {', '.join(heavy)}); keep what the sessions import light or raise "
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
        if beneath(path, entry):
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

"""The kernel calls that confine the sandbox's processes (Linux, through libc; Landlock's and
io_uring's syscall numbers are the same on x86_64 and aarch64): prctl, capabilities, user
namespaces, Landlock, and a seccomp filter on socket(2) and io_uring.

A module of their own: the zygote and the sessions confine themselves with these calls, the
python tool's fresh interpreter adds a Landlock layer of its own with them (interpreter.py), and
the python tool (python_tool.py) reuses two of them (`set_parent_death_signal`,
`describe_status`).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import signal


_libc = ctypes.CDLL(None, use_errno=True)

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
NOBODY = 65534

SYS_LANDLOCK_CREATE_RULESET = 444
SYS_LANDLOCK_ADD_RULE = 445
SYS_LANDLOCK_RESTRICT_SELF = 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
LANDLOCK_WRITE_RIGHTS_ABI1 = sum(1 << bit for bit in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12))
"""WRITE_FILE, REMOVE_DIR, REMOVE_FILE and MAKE_CHAR/DIR/REG/SOCK/FIFO/BLOCK/SYM."""
WRITE_FILE, READ_FILE, READ_DIR = 1 << 1, 1 << 2, 1 << 3
LANDLOCK_READ_RIGHTS = READ_FILE | READ_DIR
LANDLOCK_ACCESS_FS_REFER = 1 << 13  # ABI 2: links and renames across directories
LANDLOCK_ACCESS_FS_TRUNCATE = 1 << 14  # ABI 3
LANDLOCK_ACCESS_NET_TCP = (1 << 0) | (1 << 1)  # ABI 4: BIND_TCP, CONNECT_TCP
LANDLOCK_SCOPES = (1 << 0) | (1 << 1)  # ABI 6: ABSTRACT_UNIX_SOCKET, SIGNAL


SIMULATE_NO_LANDLOCK = "MCORE_RL_SANDBOX_SIMULATE_NO_LANDLOCK"
"""Tests only: set to 1 in a process's environment (for the zygote: in the rank's, and named in
SandboxLimits.environment, since the zygote sees no other variable), and `landlock_abi` reports
0 there, as on a kernel without Landlock or in a container that filters its calls, so that a
test reaches the sandbox's real no-Landlock path on a machine that has it. It can only take
confinement away where SandboxLimits.allow_unconfined allows running without it; otherwise the
sandbox refuses to start."""

SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
SOCKET_SYSCALLS = {"x86_64": (0xC000003E, 41), "aarch64": (0xC00000B7, 198)}
"""Machine -> (its AUDIT_ARCH, the number of socket(2))."""
IO_URING_SYSCALLS = (425, 426, 427)
"""io_uring_setup, io_uring_enter, io_uring_register: the same numbers on x86_64 and aarch64
(the generic table; io_uring came after the two were unified)."""
X32_SYSCALL_BIT = 0x40000000
BPF_LOAD_WORD, BPF_JUMP_IF_EQUAL, BPF_JUMP_IF_AT_LEAST, BPF_RETURN = 0x20, 0x15, 0x35, 0x06
SECCOMP_DATA_NR, SECCOMP_DATA_ARCH = 0, 4
"""Offsets in struct seccomp_data."""


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


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
    """The kernel's Landlock ABI version (0: no Landlock, its calls filtered, or
    SIMULATE_NO_LANDLOCK)."""
    if os.environ.get(SIMULATE_NO_LANDLOCK) == "1":
        return 0
    version = _libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0),
                            ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    return max(version, 0)


def restrict_files(directory: str, readable: list[tuple[int, int]], abi: int,
                   deny_tcp: bool) -> None:
    """Add a Landlock layer: file-system writes only beneath `directory` and into /dev/null
    (what `subprocess.DEVNULL` and `open(os.devnull, "w")` open); reads only there and as each
    (descriptor, READ_FILE and/or READ_DIR) of `readable` allows, beneath a folder or on a
    file;
    TCP bind/connect denied (ABI >= 4, when `deny_tcp`); signals and abstract Unix sockets only
    within the layer (ABI >= 6). Layers stack; none is ever lifted."""
    write_rights = LANDLOCK_WRITE_RIGHTS_ABI1
    write_rights |= LANDLOCK_ACCESS_FS_REFER if abi >= 2 else 0
    write_rights |= LANDLOCK_ACCESS_FS_TRUNCATE if abi >= 3 else 0
    rights = write_rights | LANDLOCK_READ_RIGHTS
    attr = _RulesetAttr(rights, LANDLOCK_ACCESS_NET_TCP if deny_tcp and abi >= 4 else 0,
                        LANDLOCK_SCOPES if abi >= 6 else 0)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8  # the fields this ABI knows
    ruleset = _libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr),
                            ctypes.c_size_t(size), ctypes.c_uint32(0))
    _check(ruleset, "landlock_create_ruleset")
    directory_fd = os.open(directory, os.O_PATH | os.O_DIRECTORY)
    null_fd = os.open(os.devnull, os.O_PATH)
    null_rights = READ_FILE | WRITE_FILE | (LANDLOCK_ACCESS_FS_TRUNCATE if abi >= 3 else 0)
    try:
        for descriptor, allowed in [(directory_fd, rights), (null_fd, null_rights), *readable]:
            rule = _PathBeneath(allowed, descriptor)
            _check(_libc.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH,
                                 ctypes.byref(rule), 0), "landlock_add_rule")
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        _check(_libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0), "landlock_restrict_self")
    finally:
        os.close(directory_fd)
        os.close(null_fd)
        os.close(ruleset)


def read_rights(path: str) -> int:
    """The Landlock read rights a rule on `path` may carry: a folder's both, a file's READ_FILE
    (the kernel refuses directory rights on a file)."""
    return LANDLOCK_READ_RIGHTS if os.path.isdir(path) else READ_FILE


def describe_status(status: int) -> str:
    """A wait status in words: "exit code 1", "killed by SIGXCPU (CPU time limit)"."""
    code = os.waitstatus_to_exitcode(status)
    if code >= 0:
        return f"exit code {code}"
    name = signal.Signals(-code).name
    reason = {signal.SIGXCPU: " (CPU time limit)", signal.SIGXFSZ: " (file size limit)"}
    return f"killed by {name}{reason.get(-code, '')}"


def can_filter_system_calls() -> bool:
    """Whether filter_system_calls knows this machine's system calls."""
    return platform.machine() in SOCKET_SYSCALLS


def filter_system_calls(deny_sockets: bool) -> None:
    """A seccomp filter on this process and its children:
    - io_uring_setup/enter/register fail with ENOSYS (as on a kernel without io_uring, so that
      programs take their fallback): io_uring's own operations open sockets (IORING_OP_SOCKET,
      Linux >= 5.19) past the socket(2) rule, and its large kernel surface is no need of a
      sandboxed program;
    - with `deny_sockets`, socket(2) fails with EACCES whatever the family (TCP, UDP, Unix,
      netlink); socketpair(2) and sockets open already keep working. Network namespaces leave
      the host's Unix sockets reachable and Landlock governs TCP only: this closes both;
    - every call of another ABI (x32, i386: its socketcall and io_uring) fails with EACCES, so
      that no second table of numbers walks around the rules (a 32-bit program cannot run)."""
    arch, socket_number = SOCKET_SYSCALLS[platform.machine()]
    foreign = SECCOMP_RET_ERRNO | errno.EACCES
    denied = [(number, errno.ENOSYS) for number in IO_URING_SYSCALLS]
    denied += [(socket_number, errno.EACCES)] if deny_sockets else []
    checks = []
    for number, error in denied:  # equal: the next step (the return); else skip it
        checks += [(BPF_JUMP_IF_EQUAL, 0, 1, number),
                   (BPF_RETURN, 0, 0, SECCOMP_RET_ERRNO | error)]
    program = [(BPF_LOAD_WORD, 0, 0, SECCOMP_DATA_ARCH),
               (BPF_JUMP_IF_EQUAL, 1, 0, arch),
               (BPF_RETURN, 0, 0, foreign),
               (BPF_LOAD_WORD, 0, 0, SECCOMP_DATA_NR),
               (BPF_JUMP_IF_AT_LEAST, len(checks) + 1, 0, X32_SYSCALL_BIT),
               *checks,
               (BPF_RETURN, 0, 0, SECCOMP_RET_ALLOW),
               (BPF_RETURN, 0, 0, foreign)]
    instructions = (_SockFilter * len(program))(*(_SockFilter(*step) for step in program))
    fprog = _SockFprog(len(program), instructions)
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0),
           "prctl(PR_SET_SECCOMP)")

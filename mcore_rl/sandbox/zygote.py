"""The zygote: the process the rank starts once (with subprocess, ZYGOTE_BOOT), which confines
itself, then forks each session, kills sessions on request, reaps them and reports their exit
statuses.

The zygote, once, in this order (unshare(CLONE_NEWUSER) needs a single-threaded process, so the
zygote never starts a thread; it checks for its parent's death in its loop instead):
1. its private directory becomes its cwd, HOME and TMPDIR: made by the rank in the system's
   temporary directory (the rank's own TMPDIR is root's alone), removed by the zygote when it
   ends, or by the next job (it is named like a rank's private folder) when the zygote was
   killed too;
2. as root, it becomes `nobody`: root ignores RLIMIT_NPROC, and root's file permissions are the
   machine's. Unless nobody could not reach the user's code or `readable` (a folder of the
   user's under one only root may enter: /root, a mkdtemp folder, pytest's): the user's code
   must run, so the zygote stays root (no process limit; Landlock still bounds what it reads),
   and the rank says so once, naming the folder (`_closed_to_nobody`). Directories on sys.path
   that nobody may not enter (a Python under /root) stay
   importable through descriptors opened before (`/proc/self/fd/N`);
3. unshare(CLONE_NEWUSER | CLONE_NEWNET): no network interface but a loopback that is down, so no
   TCP, UDP or abstract Unix socket reaches the host. Where user namespaces are blocked (Docker's
   default seccomp profile, Ubuntu's apparmor_restrict_unprivileged_userns) Landlock's TCP rules
   are the fallback (TCP only);
4. it checks that Landlock works (the kernel has it and a child can add a layer): without it
   the sessions could read whatever their user may (checkpoints, home folders, other episodes'
   folders), so the zygote refuses to start, unless SandboxLimits.allow_unconfined allows
   running so (the rank then says so once, and `mechanisms()` reports filesystem
   "unconfined"). Network confinement has its fallbacks (step 3); reads have none;
5. it becomes undumpable (no session may ptrace it), a child subreaper that kills every orphan
   reparented to it (a dead session's children), and sets PR_SET_PDEATHSIG(SIGTERM) after the
   setuid (which clears it): when the rank dies it kills its sessions, removes the directory and
   exits (it also checks every ORPHAN_CHECK_SECONDS whether the rank is still its parent).

Steps 1-5 are zygote_confinement.py's; this module holds the zygote's entry point and its loop.
"""

from __future__ import annotations

import importlib
import os
import shutil
import signal
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import recv_handle

from .errors import describe_exception
from .limits import SandboxLimits
from .session import _Confinement, _run_session
from .user_code import bind_main_objects
from .zygote_confinement import _check_room_for_sessions, _confine_zygote


ORPHAN_CHECK_SECONDS = 1.0
"""How often the zygote checks that the rank lives and kills orphans reparented to it."""

ZYGOTE_BOOT = ("import pickle, sys; sys.path[:] = pickle.loads(bytes.fromhex(sys.argv[1])); "
               "from mcore_rl.sandbox import zygote_main; "
               "zygote_main(pickle.loads(bytes.fromhex(sys.argv[2])))")
"""The zygote's command line: the rank's import path first (the setup's pickle names SandboxLimits,
of this package), then the setup."""


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
        confinement, out_of_reach, unconfined = _confine_zygote(directory, setup["limits"],
                                                                setup["code_folders"])
        # confined already: the user's import-time code runs confined too
        if setup["main_objects"]:
            bind_main_objects(setup["main_objects"])
        for module in setup["preload"]:
            importlib.import_module(module)
        _check_room_for_sessions(setup["limits"].memory_mb)
        control.send(("ready", {"mechanisms": confinement.mechanisms,
                                "out_of_reach": out_of_reach, "unconfined": unconfined}))
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

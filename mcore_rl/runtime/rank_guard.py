"""A rank's guard: once the rank is gone, however it went, nothing it started is left.

Run as its own small process (`python -I -S rank_guard.py OWNER_PID TEMP_DIR [SESSION]`, standard
library only, no torch), started by `process_guard.guard_this_rank()`. Why a separate process:
a rank killed with SIGKILL (by hand, by the OOM killer, by a test's timeout, because torchrun
died) runs no cleanup of its own, and the processes it started - forked or spawned, by the
project or by a library (Megatron's checkpoint writers and their Manager, reward and tool
workers, vLLM's helpers) - keep running with parent 1, holding memory and open files. Shared-memory
segments (vLLM's CPU communicator, multiprocessing's) and temporary files stay under their
names, and a segment with a fixed name makes the next run fail to start.

While the rank lives, the guard notes every few tenths of a second which processes descend from
it and which /dev/shm files they map. The kernel tells it when the rank is gone
(PR_SET_PDEATHSIG). Then it:
1. SIGKILLs every descendant it saw, their children, and - when SESSION is "session" (a rank
   started by torchrun, which gives each rank a session of its own) - every other process of the
   rank's session, which catches a child forked a moment before the rank died;
2. unlinks each /dev/shm file they mapped, and each one made since its last look (a semaphore a
   killed writer was creating), once no live process maps or holds it (it waits a few
   seconds for the other ranks of a dying job, whose own guards otherwise do it);
3. removes the rank's private temporary folder (the rank's TMPDIR: vLLM's and multiprocessing's
   sockets, libraries' temporary files) and the folders its sandboxes made beside it (named
   after the rank).
It ignores the signals sent to a whole job (SLURM's --signal, Ctrl-C's SIGINT, SIGTERM at the
time limit) while its rank lives, and sits in a process group of its own, so `kill -9 -PGID`
of the rank's group does not take it along.

The same file answers the start-up question "is this segment held by anyone?" for
`process_guard.reclaim_stale_files` (imported there, so the rule lives in one place).
"""

from __future__ import annotations

import ctypes
import glob
import os
import select
import shutil
import signal
import sys
import time

PR_SET_PDEATHSIG = 1
POLL_SECONDS = 0.5
"""How often the guard notes its rank's descendants and their shared memory."""

HELD_WAIT_SECONDS = 10.0
"""How long a segment still mapped by another (dying) process is re-checked before it is left
to that process's own guard."""

CREATED_SLACK_SECONDS = 1.0
"""Files created in /dev/shm since the last note (less this) that nobody holds are taken to be
the rank's: made in its last moments (a semaphore half-created by a killed writer), too late to
be noted."""

KILL_WAIT_SECONDS = 5.0
"""How long killed processes are given to be gone before the guard goes on."""

TRACKER_WAIT_SECONDS = 3.0
"""How long a resource tracker is given to unlink what was registered with it and exit, once the
processes that used it are gone."""

SHM_DIR = "/dev/shm"


def _stat(pid: int) -> tuple[int, int, int, int] | None:
    """(parent, process group, session, start time in clock ticks) of a live process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rpartition(b")")[2].split()
    except OSError:
        return None
    if fields[0] == b"Z":  # a zombie holds nothing
        return None
    return int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19])


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks after boot): with the pid, names it uniquely."""
    stat = _stat(pid)
    return stat[3] if stat else None


def process_table() -> dict[int, tuple[int, int, int, int]]:
    """Every live process: pid -> (parent, group, session, start time)."""
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _stat(int(name))
            if stat is not None:
                table[int(name)] = stat
    return table


def descendants(table: dict, roots: set[int]) -> set[int]:
    """The processes below `roots` (not the roots themselves)."""
    children: dict[int, list[int]] = {}
    for pid, (parent, *_) in table.items():
        children.setdefault(parent, []).append(pid)
    found, todo = set(), list(roots)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _shm_entries(pid: int) -> list[tuple[str, int]]:
    """(name, inode) of each /dev/shm file the process maps or has open; a removed name ends in
    " (deleted)"."""
    entries = []
    prefix = SHM_DIR + "/"
    try:
        with open(f"/proc/{pid}/maps", "rb") as handle:
            maps = handle.read().decode(errors="replace")
    except OSError:
        maps = ""
    for line in maps.splitlines():
        at = line.find(prefix)
        if at >= 0:
            fields = line.split(maxsplit=5)
            entries.append((line[at + len(prefix):], int(fields[4])))
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        fds = []
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith(prefix):
                entries.append((target[len(prefix):], os.stat(f"/proc/{pid}/fd/{fd}").st_ino))
        except OSError:
            continue
    return entries


def shm_files(pid: int) -> set[str]:
    """Names of the /dev/shm files the process maps or has open."""
    return {name for name, _ in _shm_entries(pid) if not name.endswith("(deleted)")}


def created_since(moment: float) -> set[str]:
    """Names of this user's /dev/shm files changed at or after `moment` (Unix seconds)."""
    names = set()
    for entry in os.scandir(SHM_DIR):
        try:
            status = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if status.st_uid == os.getuid() and status.st_ctime >= moment:
            names.add(entry.name)
    return names


def held_shm_inodes(exclude: set[int] = frozenset()) -> set[int]:
    """Inodes of the /dev/shm files some live process (other than `exclude`) maps or holds open.
    By inode, not name: a POSIX semaphore is mapped under the temporary name it was created with
    (`sem.XXXXXX (deleted)`) and then linked to its real name, so by name a live process's
    semaphore looks unheld (CI: a guard unlinked another test's vLLM start-up semaphore)."""
    held = set()
    for pid in process_table():
        if pid not in exclude:
            held |= {inode for _, inode in _shm_entries(pid)}
    return held


def unlink_unheld(names: set[str], exclude: set[int] = frozenset()) -> tuple[list[str], set[str]]:
    """Unlink the existing files among `names` (in /dev/shm, owned by this user) that nobody
    holds; returns (unlinked, still held)."""
    existing = {}
    for name in names:
        try:
            status = os.stat(os.path.join(SHM_DIR, name))
        except OSError:
            continue
        if status.st_uid == os.getuid():
            existing[name] = status.st_ino
    held_inodes = held_shm_inodes(exclude) if existing else set()
    held = {name for name, inode in existing.items() if inode in held_inodes}
    unlinked = []
    for name in sorted(existing.keys() - held):
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            unlinked.append(name)
        except OSError:
            pass
    return unlinked, held


class _Guard:
    def __init__(self, owner: int, temp_dir: str, whole_session: bool):
        self.owner, self.temp_dir, self.whole_session = owner, temp_dir, whole_session
        self.session = os.getsid(owner)
        self.pidfds: dict[int, int] = {}
        """Descendants seen, by pid: a pidfd names that process, never a later one."""
        self.segments: set[str] = set()
        self.last_note = time.time()
        """When `segments` was last brought up to date."""

    def owner_alive(self) -> bool:
        return os.getppid() == self.owner

    def note(self) -> None:
        """Record the rank's descendants and the shared memory it and they map."""
        table = process_table()
        for pid in descendants(table, {self.owner} | set(self.pidfds)) - {os.getpid()}:
            if pid not in self.pidfds:
                try:
                    self.pidfds[pid] = os.pidfd_open(pid)
                except OSError:
                    continue
        for pid, pidfd in list(self.pidfds.items()):
            if _exited(pidfd):
                os.close(pidfd)
                del self.pidfds[pid]
        for pid in [self.owner, *self.pidfds]:
            self.segments |= shm_files(pid)
        self.last_note = time.time()

    def end(self) -> None:
        """After the owner is gone: kill, wait, unlink, remove."""
        for step in (self.kill_everything, self.release_segments, self.remove_temp_dir):
            try:
                step()
            except Exception as error:  # one failed step must not skip the others
                print(f"rank guard of {self.owner}: {step.__name__}: {error}", file=sys.stderr)

    def kill_everything(self) -> None:
        """SIGKILL every process the rank started, multiprocessing's resource trackers last:
        once the others are gone a tracker unlinks the semaphores and segments registered with
        it (a helper's that died without cleanup, like a worker's tqdm lock) and exits by
        itself; killed with the others, it left them in /dev/shm under their names."""
        table = process_table()
        me = os.getpid()
        victims = descendants(table, set(self.pidfds)) - {me}
        if self.whole_session:
            victims |= {pid for pid, (_, _, session, _) in table.items()
                        if session == self.session and pid != me}
        for pid in victims - set(self.pidfds):
            try:
                self.pidfds[pid] = os.pidfd_open(pid)
            except OSError:
                pass
        trackers = {pid: pidfd for pid, pidfd in self.pidfds.items() if _is_resource_tracker(pid)}
        others = [pidfd for pid, pidfd in self.pidfds.items() if pid not in trackers]
        _kill_and_wait(others, KILL_WAIT_SECONDS)
        _wait(trackers.values(), TRACKER_WAIT_SECONDS)
        _kill_and_wait(trackers.values(), KILL_WAIT_SECONDS)

    def release_segments(self) -> None:
        remaining = self.segments | created_since(self.last_note - CREATED_SLACK_SECONDS)
        deadline = time.monotonic() + HELD_WAIT_SECONDS
        while remaining:
            _, remaining = unlink_unheld(remaining, {os.getpid()})
            if not remaining or time.monotonic() > deadline:
                return
            time.sleep(0.5)

    def remove_temp_dir(self) -> None:
        """The rank's private folder and those named after it beside it (its sandboxes'
        zygotes, killed above before they could remove theirs): <prefix><pid>-<start time>-*."""
        if self.temp_dir:
            owner = self.temp_dir.rpartition("-")[0]  # mkdtemp's random tail has no "-"
            for folder in glob.glob(f"{glob.escape(owner)}-*"):
                shutil.rmtree(folder, ignore_errors=True)


def _exited(pidfd: int) -> bool:
    return bool(select.select([pidfd], [], [], 0)[0])


def _wait(pidfds, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(map(_exited, pidfds)):
        time.sleep(0.05)


def _kill_and_wait(pidfds, seconds: float) -> None:
    pidfds = list(pidfds)
    for pidfd in pidfds:
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except OSError:
            pass
    _wait(pidfds, seconds)


def _is_resource_tracker(pid: int) -> bool:
    """Whether the process is a multiprocessing resource tracker (`python -c 'from
    multiprocessing.resource_tracker import main;main(FD)'`)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return b"multiprocessing.resource_tracker" in handle.read()
    except OSError:
        return False


class _OwnerGone(Exception):
    pass


def main(argv: list[str]) -> None:
    owner, temp_dir = int(argv[1]), argv[2]
    whole_session = len(argv) > 3 and argv[3] == "session"
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    os.setpgid(0, 0)
    guard = _Guard(owner, temp_dir, whole_session)

    def on_term(*_):
        if not guard.owner_alive():
            raise _OwnerGone

    for jobs_signal in (signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(jobs_signal, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, on_term)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    try:
        while guard.owner_alive():
            guard.note()
            time.sleep(POLL_SECONDS)
    except _OwnerGone:
        pass
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    guard.end()


if __name__ == "__main__":
    main(sys.argv)

"""The rank's side: `Sandbox` opens sessions, sends them requests and returns their `Reply`s
from poll(), never blocking on a session (a rank keeps many open, mostly idle). It starts the
zygote (zygote.py, through launch.py), ends a session whose call runs past its deadline, and
stops every process when shut down, garbage-collected, or at interpreter exit.

Use a Sandbox from one thread, and start it (first `open`) from a thread that lives as long as
the rank: PR_SET_PDEATHSIG fires when the thread that started the zygote exits.
"""

from __future__ import annotations

import logging
import math
import pickle
import socket
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from multiprocessing.reduction import ForkingPickler, send_handle
from typing import Any, Optional

from .channel import _Channel, load_plain_data
from .errors import describe_exception
from .kernel import describe_status
from .launch import _Processes, spawn_zygote
from .limits import SandboxLimits
from .user_code import pack_main_objects
from .zygote_confinement import out_of_reach_note


logger = logging.getLogger("mcore_rl.sandbox")

START_TIMEOUT_SECONDS = 60.0
"""How long the zygote may take to import and confine itself."""

EXIT_STATUS_WAIT_SECONDS = 0.5
"""How long a dead session's exit status (which the zygote reports) is awaited for its error."""


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


@dataclass
class _Session:
    """The rank's view of one session."""

    key: str
    serial: int
    channel: _Channel
    pid: Optional[int] = None
    """The session process (known once it has opened)."""

    queued: deque = field(default_factory=deque)
    """(pickled request, its timeout in seconds) not yet sent."""

    opening: bool = True
    """The open call is running (before its reply)."""

    sent_at: float = math.nan
    """time.monotonic() when the running call was sent (nan: idle)."""

    deadline: float = math.inf
    """time.monotonic() by which the running call must end."""

    timeout: float = math.inf
    """The running call's timeout in seconds."""

    @property
    def busy(self) -> bool:
        return self.deadline != math.inf


class Sandbox:
    """Sessions in confined processes forked from one zygote; non-blocking open/send, replies
    from poll(). See zygote.py and session.py for what confines them."""

    def __init__(self, limits: SandboxLimits, name: str = "tools", preload: tuple = (),
                 main_objects: tuple = ()):
        """preload: modules the zygote imports before forking any session, so that sessions
        start without importing them (the time counts against each call's timeout).
        main_objects: functions and classes of this process's `__main__` the sessions use,
        sent by value into the zygote's `__main__` (user_code.py); ValueError naming one that
        cannot be."""
        self.limits = limits
        self.name = name
        self.preload = tuple(preload)
        self._main_objects = pack_main_objects(main_objects) if main_objects else b""
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
        network is off and neither a network namespace nor Landlock can deny it, and when
        Landlock does not work unless limits.allow_unconfined."""
        if not self._finalizer.alive:
            raise RuntimeError(f"the {self.name} sandbox is shut down")
        if self._processes.zygote is not None:
            return
        spawn_zygote(self._processes, self.limits, self.name, self.preload, self._main_objects)
        ready = self._await_ready()
        self._mechanisms = ready["mechanisms"]
        if ready["unconfined"]:
            logger.warning("the %s sandbox: reads and writes are not confined: Landlock does "
                           "not work here (%s) and allow_unconfined is set, so its sessions "
                           "may read and write whatever their user may (file permissions only)",
                           self.name, ready["unconfined"])
        if ready["out_of_reach"]:
            logger.warning("the %s sandbox: %s", self.name,
                           out_of_reach_note(ready["out_of_reach"]))

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
        """Which guarantees hold: {"network": "netns" | "seccomp" (no new socket) | "landlock"
        (TCP only) | "allowed", "sockets": "seccomp" (socket(2) fails, UDP and the host's Unix
        sockets included) | "namespaced" (only a network namespace or Landlock) | "allowed",
        "io_uring": "seccomp" (its calls fail with ENOSYS: its IORING_OP_SOCKET would bypass
        the socket rule) | "allowed" (a machine the filter does not know), "filesystem":
        "landlock" (writes only beneath the session's directory, reads only there, in the
        system's folders, the Python installation, the code on the import path and `readable`;
        the python tool's interpreter reads fewer: interpreter.py) | "unconfined" (Landlock
        does not work and limits.allow_unconfined allowed running so: whatever the user may
        read and write), "processes": "rlimit-nproc" (per session) | "rlimit-nproc-shared" (one
        count for all sessions) | "none" (root), "user": "nobody" | "root" | the user's name,
        "signals": "landlock-scope" (no signal, ptrace or abstract Unix socket reaches outside
        the session) | "uid" (only uids keep sessions from signalling each other, and - when
        the rank is not root - the rank)}. Starts the zygote if needed."""
        self.start()
        return dict(self._mechanisms)

    def open(self, key: str, factory: str, argument: Any,
             timeout_seconds: Optional[float] = None) -> None:
        """Start session `key`: in a new confined process, `handler = resolve(factory)(argument)`
        ("package.module:attribute", importable there). Non-blocking: its Reply (value None)
        comes from poll(); a factory that raises gives ok=False, ended=True. timeout_seconds:
        this call's, instead of the limits' (a factory that imports what it serves)."""
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
        self._transmit(session, message, timeout_seconds)

    def send(self, key: str, request: Any, timeout_seconds: Optional[float] = None) -> None:
        """Queue one request for session `key` (non-blocking; a session's requests run one at a
        time, in order). Its Reply carries handler(request); an exception from the handler is
        ok=False and the session goes on; past its timeout (timeout_seconds, else the limits')
        the session is killed (ended). To an unknown or ended session: Reply(ok=False,
        error="session ended", ended=True)."""
        session = self._sessions.get(key)
        if session is None:
            self._ready.append(Reply(key, False, None, "session ended", 0.0, True))
            return
        message = self._pickle(key, request)
        if message is None:
            return
        session.queued.append((message, timeout_seconds))
        if not session.busy:
            self._transmit(session, *session.queued.popleft())

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

    def _transmit(self, session: _Session, message: bytes,
                  timeout_seconds: Optional[float]) -> None:
        session.sent_at = time.monotonic()
        session.timeout = timeout_seconds or self.limits.timeout_seconds
        session.deadline = session.sent_at + session.timeout
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
            self._transmit(session, *session.queued.popleft())

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
                                         f"timeout after {session.timeout} s",
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

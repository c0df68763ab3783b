"""The tool sandbox (mcore_rl/sandbox/) and the python tool, with real processes: what a
session may do, what the kernel refuses it, and that no process outlives the sandbox or its
parent. Handlers: tests/agent_sandbox_handlers.py. Every loop is bounded, every socket on
loopback."""

import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from mcore_rl.agents.python_tool import run_python
from mcore_rl.sandbox import Reply, Sandbox, SandboxLimits
from mcore_rl.runtime.rank_guard import start_time

TOOLBOX = "agent_sandbox_handlers:Toolbox"
LIMITS = SandboxLimits(timeout_seconds=1.5, memory_mb=256, cpu_seconds=5.0, max_processes=8,
                       max_file_mb=1)
REPLY_WAIT_SECONDS = 10.0
"""How long a test waits for a reply that should come within a call's timeout."""
SLOW_CALL_SECONDS = 8.0
"""A call's timeout where a fresh interpreter starts (LIMITS' 1.5 s is short on a loaded
machine)."""


@pytest.fixture(scope="module")
def sandbox():
    sandbox = Sandbox(LIMITS, name="test")
    yield sandbox
    sandbox.shutdown()


@pytest.fixture(scope="module")
def host_files():
    """A folder of the host's that anyone may read (a checkpoint, a dataset of answers), none of
    the default sandbox's `readable`."""
    folder = tempfile.mkdtemp(prefix="mcore_rl-host-files-", dir="/tmp")
    os.chmod(folder, 0o755)
    for name, text in (("checkpoint.pt", "weights"), ("answers.json", '{"q1": "4711"}')):
        with open(os.path.join(folder, name), "w") as handle:
            handle.write(text)
        os.chmod(os.path.join(folder, name), 0o644)
    yield folder
    shutil.rmtree(folder)


@pytest.fixture(scope="module")
def readable_sandbox(host_files):
    """A sandbox whose `readable` holds host_files, as an environment's dataset would be."""
    sandbox = Sandbox(dataclasses.replace(LIMITS, readable=(host_files,)), name="test-readable")
    yield sandbox
    sandbox.shutdown()


def replies_for(sandbox: Sandbox, count: int) -> dict[str, list[Reply]]:
    """The next `count` replies, by session key."""
    replies: dict[str, list[Reply]] = {}
    deadline = time.monotonic() + REPLY_WAIT_SECONDS
    received = 0
    while received < count and time.monotonic() < deadline:
        for reply in sandbox.poll(timeout=0.2):
            replies.setdefault(reply.key, []).append(reply)
            received += 1
    assert received == count, f"{received} of {count} replies within {REPLY_WAIT_SECONDS} s"
    return replies


def call(sandbox: Sandbox, key: str, request, timeout_seconds=None) -> Reply:
    sandbox.send(key, request, timeout_seconds)
    (reply,) = replies_for(sandbox, 1)[key]
    return reply


def opened(sandbox: Sandbox, *keys: str, start: int = 0) -> None:
    for key in keys:
        sandbox.open(key, TOOLBOX, start)
    replies = replies_for(sandbox, len(keys))
    for key in keys:
        assert replies[key][0].ok and not replies[key][0].ended, replies[key]


def gone(pid: int, started: int, within_seconds: float = 5.0) -> bool:
    """Whether the process (pid, start time) is gone - or a zombie - within the time."""
    deadline = time.monotonic() + within_seconds
    while start_time(pid) == started:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_state_persists_per_session_and_sessions_are_apart(sandbox):
    opened(sandbox, "counter-a")
    sandbox.open("counter-b", TOOLBOX, 100)
    assert replies_for(sandbox, 1)["counter-b"][0].ok
    for request in (("add", 1), ("add", 2)):
        sandbox.send("counter-a", request)
    sandbox.send("counter-b", ("add", 1))
    replies = replies_for(sandbox, 3)
    assert [reply.value for reply in replies["counter-a"]] == [1, 3]  # in order, state kept
    assert [reply.value for reply in replies["counter-b"]] == [101]
    directory_a = call(sandbox, "counter-a", ("cwd",)).value
    directory_b = call(sandbox, "counter-b", ("cwd",)).value
    assert directory_a != directory_b and os.path.dirname(directory_a) == os.path.dirname(
        directory_b)
    pids = sandbox.pids()
    assert pids["counter-a"] != pids["counter-b"] != pids["zygote"] != os.getpid()


def test_mechanisms_on_this_machine_deny_the_network(sandbox):
    mechanisms = sandbox.mechanisms()
    assert mechanisms["network"] in ("netns", "landlock"), mechanisms
    if os.getuid() == 0:
        assert mechanisms["user"] in ("nobody", "root"), mechanisms


def test_handler_error_is_a_reply_and_the_session_goes_on(sandbox):
    opened(sandbox, "raises")
    reply = call(sandbox, "raises", ("fail", "no such tool"))
    assert (reply.ok, reply.error, reply.ended) == (False, "ValueError: no such tool", False)
    assert call(sandbox, "raises", ("add", 5)).value == 5


def test_only_plain_data_comes_back(sandbox):
    opened(sandbox, "replies")
    reply = call(sandbox, "replies", ("itself",))
    assert not reply.ok and not reply.ended
    assert reply.error.startswith("the reply cannot be sent back (only plain data can): "
                                  "UnpicklingError: agent_sandbox_handlers.Toolbox"), reply.error
    assert call(sandbox, "replies", ("add", 1)).value == 1


def test_failing_factory_ends_its_session(sandbox):
    sandbox.open("bad-start", TOOLBOX, -1)
    (reply,) = replies_for(sandbox, 1)["bad-start"]
    assert not reply.ok and reply.ended
    assert reply.error == "ValueError: a toolbox starts at 0 or more, not -1"
    late = call(sandbox, "bad-start", ("add", 1))
    assert (late.ok, late.error, late.ended) == (False, "session ended", True)


def test_hanging_call_is_killed_at_the_timeout_and_others_go_on(sandbox):
    opened(sandbox, "hangs", "bystander")
    pid = sandbox.pids()["hangs"]
    started = start_time(pid)
    sandbox.send("hangs", ("spin",))
    sandbox.send("hangs", ("add", 1))  # queued behind the hang: answered "session ended"
    sandbox.send("bystander", ("add", 7))
    replies = replies_for(sandbox, 3)
    assert replies["bystander"][0].value == 7
    timeout, queued = replies["hangs"]
    assert (timeout.ok, timeout.error, timeout.ended) == (False, "timeout after 1.5 s", True)
    # at the timeout, with slack for a loaded machine
    assert LIMITS.timeout_seconds <= timeout.seconds < LIMITS.timeout_seconds + 3.0
    assert (queued.error, queued.ended) == ("session ended", True)
    assert gone(pid, started)
    assert call(sandbox, "bystander", ("add", 1)).value == 8
    opened(sandbox, "after-the-hang")
    assert call(sandbox, "after-the-hang", ("add", 2)).value == 2


def test_cpu_time_limit_ends_the_session():
    sandbox = Sandbox(SandboxLimits(timeout_seconds=10.0, cpu_seconds=1.0), name="test-cpu")
    try:
        opened(sandbox, "spins")
        reply = call(sandbox, "spins", ("spin",))
    finally:
        sandbox.shutdown()
    assert (reply.ok, reply.ended) == (False, True)
    assert reply.error == "session process died (killed by SIGXCPU (CPU time limit))"


def test_memory_bomb_is_refused_and_the_session_goes_on(sandbox):
    opened(sandbox, "allocates")
    reply = call(sandbox, "allocates", ("allocate", 16 * LIMITS.memory_mb))
    assert (reply.ok, reply.error, reply.ended) == (False, "MemoryError", False)
    assert call(sandbox, "allocates", ("allocate", 16)).value == f"allocated {16 << 20} bytes"


def test_network_is_denied_inside_but_works_outside(sandbox):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
        opened(sandbox, "connects")
        reply = call(sandbox, "connects", ("connect", port))
    assert reply.value in ("refused: Network is unreachable", "refused: Permission denied")


def test_no_socket_reaches_the_host_neither_unix_nor_udp(sandbox):
    """A network namespace keeps the host's Unix sockets reachable and Landlock governs TCP
    only: the seccomp filter fails every new socket, even to a Unix socket anyone may use."""
    if sandbox.mechanisms()["sockets"] != "seccomp":
        pytest.skip(f"no seccomp socket filter here: {sandbox.mechanisms()}")
    folder = tempfile.mkdtemp(prefix="mcore_rl-host-socket-", dir="/tmp")  # anyone may enter
    os.chmod(folder, 0o755)
    path = os.path.join(folder, "host.sock")
    with contextlib.ExitStack() as cleanup, socket.socket(socket.AF_UNIX) as unix, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        cleanup.callback(shutil.rmtree, folder)
        unix.bind(path)
        os.chmod(path, 0o777)
        unix.listen(1)
        udp.bind(("127.0.0.1", 0))
        opened(sandbox, "sockets")
        assert call(sandbox, "sockets", ("connect_unix", path)).value == \
            "refused: Permission denied"
        assert call(sandbox, "sockets", ("send_udp", udp.getsockname()[1])).value == \
            "refused: Permission denied"
        assert call(sandbox, "sockets", ("socketpair",)).value == "within"
        unix.setblocking(False)
        with pytest.raises(BlockingIOError):
            unix.accept()


def test_reads_only_code_the_system_its_own_folder_and_what_is_allowed(sandbox, host_files,
                                                                       readable_sandbox):
    """Landlock's read rules: a file anyone may read (a checkpoint, a token in a home folder)
    is refused, as is a neighbour session's file; the session's own folder, the code on the
    import path and a folder named in `readable` are readable."""
    if sandbox.mechanisms()["filesystem"] != "landlock":
        pytest.skip("no Landlock on this kernel: reads are limited by file permissions only")
    secret = os.path.join(host_files, "checkpoint.pt")
    opened(sandbox, "reads", "reads-neighbour")
    assert call(sandbox, "reads", ("read", secret)).value == "refused: Permission denied"
    neighbour = os.path.join(call(sandbox, "reads-neighbour", ("cwd",)).value, "note")
    assert call(sandbox, "reads-neighbour", ("write", neighbour)).value == "written"
    assert call(sandbox, "reads", ("read", neighbour)).value == "refused: Permission denied"
    assert call(sandbox, "reads-neighbour", ("read", neighbour)).value == "x"
    handlers = os.path.join(os.path.dirname(__file__), "agent_sandbox_handlers.py")
    assert "class Toolbox" in call(sandbox, "reads", ("read", handlers)).value
    opened(readable_sandbox, "allowed")
    assert call(readable_sandbox, "allowed", ("read", secret)).value == "weights"


def test_writes_only_beneath_the_sessions_directory(sandbox):
    if sandbox.mechanisms()["filesystem"] != "landlock":
        pytest.skip("no Landlock on this kernel: writes are limited by file permissions only")
    opened(sandbox, "writes", "neighbour")
    outside = f"/tmp/mcore_rl-escape-{uuid.uuid4().hex}"
    assert call(sandbox, "writes", ("write", outside)).value == "refused: Permission denied"
    assert not os.path.exists(outside)
    neighbour_file = os.path.join(call(sandbox, "neighbour", ("cwd",)).value, "planted")
    assert call(sandbox, "writes", ("write", neighbour_file)).value == "refused: Permission denied"
    assert call(sandbox, "writes", ("write", "inside.txt")).value == "written"
    # ... and /dev/null, which subprocess.DEVNULL and open(os.devnull, "w") open
    assert call(sandbox, "writes", ("write", os.devnull)).value == "written"
    inside = os.path.join(call(sandbox, "writes", ("cwd",)).value, "inside.txt")
    assert open(inside).read() == "x"


def test_fork_loop_stops_at_the_process_limit(sandbox):
    opened(sandbox, "forks")
    reply = call(sandbox, "forks", ("fork_children", 64, 0.3))
    assert reply.ok, reply
    assert reply.value == (f"forked {LIMITS.max_processes}, then: Resource temporarily "
                           "unavailable"), reply.value


def test_python_tool(sandbox):
    opened(sandbox, "python")

    def python(code: str, timeout_seconds: float = 1.0, max_output_chars: int = 4000) -> str:
        return call(sandbox, "python", ("python", code, timeout_seconds, max_output_chars)).value

    assert python("print('hello'); print(6 * 7)") == "hello\n42\n"
    assert python("print('before')\n{}['missing']") == "before\nKeyError: 'missing'\n"
    assert python("while True:\n    pass", timeout_seconds=0.5) == "error: timed out after 0.5 s"
    assert python("print('x' * 10000)", max_output_chars=100) == (
        "x" * 100 + "\n[output truncated to 100 characters]")
    assert python("blob = bytearray(1 << 30)") == (
        "MemoryError: the code ran out of its 256 MB of memory\n")
    leaves_a_child = "import os, time\nif os.fork() == 0:\n    time.sleep(30)\nprint('parent')"
    assert python(leaves_a_child) == "parent\n"
    # outside the sandbox too, where no subreaper kills the orphan: the child holding the
    # output dies when the code exits, and the call does not wait out its timeout
    assert run_python(leaves_a_child, timeout_seconds=30, memory_mb=256) == "parent\n"
    assert call(sandbox, "python", ("children",)).value == []  # nothing left behind
    forge_replies = ("import os, struct\nfor fd in range(3, 256):\n    try:\n"
                     "        os.write(fd, struct.pack('!i', 5) + b'forged')\n"
                     "    except OSError:\n        pass")
    assert python(forge_replies) == ""  # the session's channel is not among its descriptors
    assert call(sandbox, "python", ("add", 3)).value == 3
    assert python("x = 1") == ""  # no state kept between calls
    assert python("print(x)") == "NameError: name 'x' is not defined\n"


def test_shutdown_leaves_no_process_and_no_directory():
    sandbox = Sandbox(LIMITS, name="test-shutdown")
    opened(sandbox, "one", "two")
    sandbox.send("two", ("spin",))
    directory = sandbox.directory
    assert os.path.dirname(call(sandbox, "one", ("cwd",)).value) == directory
    processes = {pid: start_time(pid) for pid in sandbox.pids().values()}
    sandbox.shutdown()
    sandbox.shutdown()
    assert len(processes) == 3 and all(gone(pid, started) for pid, started in processes.items())
    assert not os.path.exists(directory)
    with pytest.raises(RuntimeError, match="shut down"):
        sandbox.open("three", TOOLBOX, 0)


PARENT_SCRIPT = """
import json, sys, time
from mcore_rl.sandbox import Sandbox, SandboxLimits
sandbox = Sandbox(SandboxLimits(timeout_seconds=30, max_processes=8), name="test-orphans")
for key in ("a", "b", "c"):
    sandbox.open(key, "agent_sandbox_handlers:Toolbox", 0)
replies = []
deadline = time.monotonic() + 10
while len(replies) < 3 and time.monotonic() < deadline:
    replies += sandbox.poll(0.2)
sandbox.send("c", ("spin",))
sandbox.send("b", ("python", "import time; time.sleep(30)", 30))
sandbox.send("a", ("cwd",))
while not any(reply.key == "a" for reply in sandbox.poll(0.2)) and time.monotonic() < deadline:
    pass
print(json.dumps(sandbox.pids()), flush=True)
print(sandbox.directory, flush=True)
time.sleep(30)
"""


def test_parent_killed_takes_every_sandbox_process_along():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.path.join(root, "tests")]))
    parent = subprocess.Popen([sys.executable, "-c", PARENT_SCRIPT], cwd=root, env=environment,
                              stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(parent.stdout.readline())
        directory = parent.stdout.readline().strip()
        assert sorted(pids) == ["a", "b", "c", "zygote"]
        deadline = time.monotonic() + 5
        while len(_with_descendants(pids.values())) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)  # the python tool's process under session "b" is starting
        processes = {pid: start_time(pid) for pid in _with_descendants(pids.values())}
        assert len(processes) >= 5, processes
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    alive = [pid for pid, started in processes.items() if not gone(pid, started)]
    assert alive == []
    assert os.path.isabs(directory) and not os.path.exists(directory)  # the zygote removed it


def _with_descendants(pids) -> set[int]:
    found = set(pids)
    for pid in list(found):
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as handle:
                found |= {int(child) for child in handle.read().split()}
        except OSError:
            pass
    return found


def test_python_tool_code_sees_no_episode_state_and_no_secrets(sandbox, monkeypatch):
    """The session holds an episode's answer, the rank a token: the model's code finds neither
    (it ran in a fork of the session: gc.get_objects() printed the answer). Also outside a
    sandbox."""

    opened(sandbox, "episode")
    search = ("import gc, os\nneedle, mine = 'answer-' + str(4700 + 11), globals()\n"
              "print(any(needle in repr(o) for o in gc.get_objects()\n"
              "          if isinstance(o, dict) and o is not mine),\n"
              "      os.environ.get('WANDB_API_KEY'))")
    assert call(sandbox, "episode", ("hold", "answer-4711")).value == "holding"
    assert call(sandbox, "episode", ("python", search, 10.0, 4000)).value == "False None\n"
    monkeypatch.setenv("WANDB_API_KEY", "token-4711")
    row = {"ground_truth": "answer-" + "4711"}
    assert run_python(search, timeout_seconds=10, memory_mb=256) == "False None\n"
    assert row["ground_truth"] == "answer-4711"  # held while the code ran


def test_python_tool_reads_neither_the_environments_readable_nor_the_code(readable_sandbox,
                                                                          host_files):
    """`readable` is the environment's (its dataset: the answers), and so are the user's code
    folders: the session reads them, the model's code in the python tool reads neither (a
    Landlock layer of its own), and its refusal is the observation, not a crash. What Python
    needs (the standard library, site-packages, the session's folder) still works, and another
    process's /proc entry (its command line) is out of reach."""
    if readable_sandbox.mechanisms()["filesystem"] != "landlock":
        pytest.skip("no Landlock on this kernel: reads are limited by file permissions only")
    answers = os.path.join(host_files, "answers.json")
    handlers = os.path.join(os.path.dirname(__file__), "agent_sandbox_handlers.py")
    opened(readable_sandbox, "env")
    assert call(readable_sandbox, "env", ("read", answers)).value == '{"q1": "4711"}'
    assert "class Toolbox" in call(readable_sandbox, "env", ("read", handlers)).value
    session = readable_sandbox.pids()["env"]

    def python(code: str) -> str:
        reply = call(readable_sandbox, "env", ("python", code, 5.0), SLOW_CALL_SECONDS)
        assert reply.ok, reply
        return reply.value

    assert python(f"print(open({answers!r}).read())") == (
        f"PermissionError: [Errno 13] Permission denied: {answers!r}\n")
    assert python(f"print(open({handlers!r}).read())") == (
        f"PermissionError: [Errno 13] Permission denied: {handlers!r}\n")
    assert python(f"print(open('/proc/{session}/cmdline').read())") == (
        f"PermissionError: [Errno 13] Permission denied: '/proc/{session}/cmdline'\n")
    assert python("import json, cloudpickle\nopen('mine.txt', 'w').write('kept')\n"
                  "print(json.dumps(open('mine.txt').read()))") == '"kept"\n'
    assert call(readable_sandbox, "env", ("add", 1)).value == 1  # the session goes on


def test_python_tool_code_is_not_in_its_command_line(sandbox):
    """/proc/<pid>/cmdline is readable to every process of the machine: code passed in argv
    would show one episode's code to another episode's environment. It travels on stdin."""
    opened(sandbox, "cmdline")
    needle = "cmdline-probe-4711"
    code = (f"import time\nseen = {needle!r} in open('/proc/self/cmdline').read()\n"
            "time.sleep(1.0)\nprint(seen)")
    sandbox.send("cmdline", ("python", code, 5.0), SLOW_CALL_SECONDS)
    session = sandbox.pids()["cmdline"]
    deadline, argv = time.monotonic() + REPLY_WAIT_SECONDS, []
    while "-u" not in argv and time.monotonic() < deadline:  # the interpreter, once exec'd
        with open(f"/proc/{session}/task/{session}/children") as handle:
            children = handle.read().split()
        with contextlib.suppress(OSError, IndexError):
            with open(f"/proc/{children[0]}/cmdline", "rb") as handle:
                argv = handle.read().decode(errors="replace").split("\0")
        time.sleep(0.02)
    assert "-u" in argv, "the python tool's interpreter was not seen running"
    assert not any(needle in argument for argument in argv), argv
    (reply,) = replies_for(sandbox, 1)["cmdline"]
    assert reply.value == "False\n"


def test_io_uring_is_refused_in_a_session(sandbox):
    """The seccomp filter fails socket(2), but io_uring opens sockets of its own
    (IORING_OP_SOCKET, Linux >= 5.19): its three calls fail with ENOSYS in a session and what
    it starts, here the python tool's code."""
    if platform.machine() not in ("x86_64", "aarch64"):
        pytest.skip(f"the seccomp filter does not know {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    ring = libc.syscall(425, 1, ctypes.create_string_buffer(120))  # io_uring_setup
    if ring < 0:
        pytest.skip("io_uring_setup fails here even unsandboxed "
                    f"({os.strerror(ctypes.get_errno())}): nothing to deny")
    os.close(ring)
    opened(sandbox, "io-uring")
    code = ("import ctypes, errno\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "for call in ((425, 1, ctypes.create_string_buffer(120)), (426, -1, 0, 0, 0, None, 0),"
            " (427, -1, 0, None, 0)):\n"
            "    result = libc.syscall(*call)\n"
            "    print(result, errno.errorcode.get(ctypes.get_errno()))")
    reply = call(sandbox, "io-uring", ("python", code, 5.0), SLOW_CALL_SECONDS)
    assert reply.value == "-1 ENOSYS\n" * 3, reply


def test_sessions_see_only_the_allowed_environment(monkeypatch):
    """A rank's credentials do not reach sessions; variables a job allows do, and the library
    path a cluster's Python may need to start (an Lmod module's LD_LIBRARY_PATH)."""
    monkeypatch.setenv("WANDB_API_KEY", "token-4711")
    monkeypatch.setenv("SIMULATED_USER_KEY", "allowed-4711")
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/lmod/python-3.11/lib")
    sandbox = Sandbox(SandboxLimits(environment=("SIMULATED_USER_KEY",)), name="environ")
    try:
        opened(sandbox, "s")
        seen = [call(sandbox, "s", ("variable", name)).value
                for name in ("WANDB_API_KEY", "SIMULATED_USER_KEY", "PATH", "LD_LIBRARY_PATH")]
    finally:
        sandbox.shutdown()
    assert seen == [None, "allowed-4711", os.environ["PATH"], "/opt/lmod/python-3.11/lib"]


@pytest.mark.skipif(os.getuid() != 0, reason="the sessions of a non-root rank run as its user")
def test_user_code_nobody_cannot_reach_keeps_the_sessions_root_and_says_so(tmp_path, caplog):
    """Under root, sessions run as nobody, unless a folder of the user's code or `readable`
    is closed to nobody (pytest's folders are: /tmp/pytest-of-root is root's alone); then they
    run as root, said once, and read it."""
    (tmp_path / "table.txt").write_text("7")
    opened_to_all = Sandbox(LIMITS, name="as-nobody")
    closed = Sandbox(dataclasses.replace(LIMITS, readable=(str(tmp_path),)), name="as-root")
    try:
        assert opened_to_all.mechanisms()["user"] == "nobody"
        with caplog.at_level(logging.WARNING, logger="mcore_rl.sandbox"):
            mechanisms = closed.mechanisms()
        assert (mechanisms["user"], mechanisms["processes"]) == ("root", "none")
        assert "the as-root sandbox: its sessions run as root" in caplog.text
        stop = [folder for folder in tmp_path.parents if folder.stat().st_mode & 0o7 == 0][-1]
        assert f"{tmp_path}: {stop} (mode 700, owner uid 0)" in caplog.text
        opened(closed, "s")
        assert call(closed, "s", ("read", str(tmp_path / "table.txt"))).value == "7"
    finally:
        opened_to_all.shutdown()
        closed.shutdown()


def test_without_landlock_the_sandbox_refuses_to_start_unless_allowed_unconfined(monkeypatch,
                                                                                 caplog,
                                                                                 host_files):
    """Where Landlock does not work (simulated in the zygote through the documented seam
    kernel.SIMULATE_NO_LANDLOCK: landlock_abi() reports 0 there) nothing confines reads, so the
    sandbox refuses to start, naming the setting; allow_unconfined starts it, says so once and
    reports filesystem "unconfined", and then a session does read the host's files."""
    from mcore_rl.sandbox import kernel

    monkeypatch.setenv(kernel.SIMULATE_NO_LANDLOCK, "1")
    limits = dataclasses.replace(LIMITS, environment=(kernel.SIMULATE_NO_LANDLOCK,))
    refused = Sandbox(limits, name="test-no-landlock")
    with pytest.raises(RuntimeError) as refusal:
        refused.start()
    message = str(refusal.value)
    assert message.startswith("the test-no-landlock sandbox cannot start: RuntimeError: Landlock "
                              f"does not work here ({kernel.SIMULATE_NO_LANDLOCK} is set)")
    assert "rollout.multi_turn.sandbox.allow_unconfined" in message
    unconfined = Sandbox(dataclasses.replace(limits, allow_unconfined=True), name="test-unconfined")
    try:
        with caplog.at_level(logging.WARNING, logger="mcore_rl.sandbox"):
            assert unconfined.mechanisms()["filesystem"] == "unconfined"
            opened(unconfined, "s")
            checkpoint = os.path.join(host_files, "checkpoint.pt")
            assert call(unconfined, "s", ("read", checkpoint)).value == "weights"
            python = call(unconfined, "s", ("python", "print(6 * 7)", 5.0), SLOW_CALL_SECONDS)
            assert python.value == "42\n", python
    finally:
        unconfined.shutdown()
    warnings = [record.getMessage() for record in caplog.records
                if record.name == "mcore_rl.sandbox"]
    assert len(warnings) == 1 and warnings[0].startswith(
        "the test-unconfined sandbox: reads and writes are not confined: Landlock does not work "
        f"here ({kernel.SIMULATE_NO_LANDLOCK} is set) and allow_unconfined is set"), warnings

"""Session handlers for tests/test_agent_sandbox.py, loaded in sandboxed sessions by
"agent_sandbox_handlers:Toolbox" (pytest puts tests/ on sys.path, and the sandbox passes the
rank's sys.path on). Each request is (method name, *arguments); each method tries one thing the
sandbox must allow or refuse and says what happened."""

import os
import socket
import time

from mcore_rl.agents.python_tool import run_python


class Toolbox:
    """A stateful handler: `total` lives as long as its session."""

    def __init__(self, start: int):
        if start < 0:
            raise ValueError(f"a toolbox starts at 0 or more, not {start}")
        self.total = start

    def __call__(self, request: tuple):
        name, *arguments = request
        return getattr(self, name)(*arguments)

    def add(self, amount: int) -> int:
        self.total += amount
        return self.total

    def fail(self, message: str) -> None:
        raise ValueError(message)

    def variable(self, name: str) -> str | None:
        """This session's value of environment variable `name`."""
        return os.environ.get(name)

    def hold(self, answer: str) -> str:
        """Keep an episode's answer in this session's memory."""
        self.answer = {"ground_truth": answer}
        return "holding"

    def spin(self) -> None:
        while True:
            pass

    def allocate(self, megabytes: int) -> str:
        blob = bytearray(megabytes << 20)
        return f"allocated {len(blob)} bytes"

    def connect(self, port: int) -> str:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2):
                return "connected"
        except OSError as error:
            return f"refused: {error.strerror}"

    def connect_unix(self, path: str) -> str:
        try:
            with socket.socket(socket.AF_UNIX) as client:
                client.connect(path)
                client.sendall(b"escaped")
                return "connected"
        except OSError as error:
            return f"refused: {error.strerror}"

    def send_udp(self, port: int) -> str:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
                client.sendto(b"escaped", ("127.0.0.1", port))
                return "sent"
        except OSError as error:
            return f"refused: {error.strerror}"

    def socketpair(self) -> str:
        first, second = socket.socketpair()
        with first, second:
            first.sendall(b"within")
            return second.recv(16).decode()

    def read(self, path: str) -> str:
        try:
            with open(path) as handle:
                return handle.read()
        except OSError as error:
            return f"refused: {error.strerror}"

    def write(self, path: str) -> str:
        try:
            with open(path, "w") as handle:
                handle.write("x")
            return "written"
        except OSError as error:
            return f"refused: {error.strerror}"

    def fork_children(self, count: int, sleep_seconds: float) -> str:
        """Fork up to `count` children that sleep, then exit; how many forks succeeded."""
        children, refusal = [], ""
        for _ in range(count):
            try:
                pid = os.fork()
            except OSError as error:
                refusal = error.strerror
                break
            if pid == 0:
                time.sleep(sleep_seconds)
                os._exit(0)
            children.append(pid)
        for pid in children:
            os.waitpid(pid, 0)
        return f"forked {len(children)}" + (f", then: {refusal}" if refusal else "")

    def python(self, code: str, timeout_seconds: float, max_output_chars: int = 4000) -> str:
        return run_python(code, timeout_seconds, memory_mb=256, max_output_chars=max_output_chars)

    def itself(self) -> "Toolbox":
        """A reply that is not plain data."""
        return self

    def children(self) -> list[int]:
        """This session's live child processes."""
        with open(f"/proc/self/task/{os.getpid()}/children") as handle:
            return [int(pid) for pid in handle.read().split()]

    def cwd(self) -> str:
        return os.getcwd()

"""The built-in `python` tool: run model-written code, give back what it printed.

It is called inside a sandbox session (sandbox/: no network, writes only in the session's
directory, bounded processes and memory) and runs each piece of code in a fresh interpreter
(forked, then exec'd: `sandbox.fresh_interpreter`), so that a hang, a memory blow-up or a crash
costs that call only, and nothing the code does (globals, imports, monkey-patches, open files)
reaches the next call or the session's environment. Not a fork of the session alone: the session's
process holds the episode (the environment, the dataset row and its ground truth), which a fork
would hand to the model's code (`gc.get_objects()`), a reward-hacking path RL finds. The code sees
an allow-listed environment (`ENVIRONMENT`), none of the rank's variables (tokens, credentials).
Inside a sandbox the interpreter also runs in a Landlock domain of its own, below the session's
(`sandbox.confine_interpreter`): the session may read the environment's dataset
(`sandbox.readable`) and the user's code, the model's code reads neither, only the Python
installation, system libraries, its own /proc entry and the session's directory. The code reaches
the interpreter on its standard input (a memfd), not in its argv: /proc/<pid>/cmdline is
readable to every process, so an argument would show one episode's code to another. That
process closes every descriptor it inherited but its output and its interpreter's (the
session's channel to the rank above all: model code must not speak for the session), sits in a
process group of its own (killed as a group when it exits or at the deadline, which takes its
children along: a background child holding the output costs no wait), dies with the session
(PDEATHSIG), and has its own RLIMIT_AS and RLIMIT_CPU. Its file descriptors 1 and 2 go into one
pipe, so output of C code and of programs it starts is captured too; the caller keeps the first
max_output_chars characters and discards the rest as it reads, so the code never blocks on a full
pipe.
"""

from __future__ import annotations

import math
import os
import resource
import select
import signal
import sys
import time

from ..sandbox import (BASIC_ENVIRONMENT, confine_interpreter, describe_status, fresh_interpreter,
                       set_parent_death_signal)

READ_CHUNK_BYTES = 1 << 16
ENVIRONMENT = (*BASIC_ENVIRONMENT, "TMPDIR")
"""The only environment variables the code sees: a session's basics (and HOME, which is TMPDIR:
the session's directory), not what a job allows its environments."""

_RUNNER = r"""
import os, sys, traceback
code = sys.stdin.buffer.read().decode("utf-8", "surrogatepass")
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
os.close(null)
memory_mb = sys.argv[1]
del sys.argv[1:], null
status = 0
try:
    exec(compile(code, "<python tool>", "exec"), {"__name__": "__main__"})
except SystemExit as exit_request:
    if exit_request.code is None or isinstance(exit_request.code, int):
        status = exit_request.code or 0
    else:
        print(exit_request.code, file=sys.stderr)
        status = 1
except MemoryError:
    print(f"MemoryError: the code ran out of its {memory_mb} MB of memory", file=sys.stderr)
except BaseException as error:
    print("".join(traceback.format_exception_only(type(error), error)).rstrip(),
          file=sys.stderr)
sys.stdout.flush()
sys.stderr.flush()
sys.exit(status)
"""
"""The fresh interpreter's program: the code, read whole from its standard input (which then
becomes /dev/null, so that input() ends at once), as __main__; the exception's last traceback
line when it raises."""


def run_python(code: str, timeout_seconds: float, memory_mb: int,
               max_output_chars: int = 4000) -> str:
    """Run `code` as a script in a new process; return its stdout and stderr (at most
    `max_output_chars` characters, then a note), with the exception's last traceback line when
    it raised, or "error: timed out after X s" / the signal that ended it. Never raises for the
    code's failures; leaves no process behind."""
    if "\0" in code:
        return "error: the code contains a NUL character"
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        pid, read_end = _start(code, timeout_seconds, memory_mb)
    except OSError as error:  # out of processes or descriptors
        return f"error: the code could not be started ({error.strerror})"
    try:
        output, timed_out = _collect(pid, read_end, timeout_seconds, max_output_chars)
    finally:
        os.close(read_end)
        status = _end(pid)
    if timed_out:
        return _join(output, f"error: timed out after {timeout_seconds} s")
    code_or_signal = os.waitstatus_to_exitcode(status)
    return output if code_or_signal == 0 else _join(output, f"error: {describe_status(status)}")


def _start(code: str, timeout_seconds: float, memory_mb: int) -> tuple[int, int]:
    """Fork the process that runs the code; (its pid, the read end of its output)."""
    code_fd = _code_file(code)
    try:
        read_end, write_end = os.pipe()
        try:
            pid = os.fork()
        except OSError:
            os.close(read_end)
            os.close(write_end)
            raise
        if pid == 0:
            os.close(read_end)
            _execute(code_fd, write_end, timeout_seconds, memory_mb)  # never returns
    finally:
        os.close(code_fd)
    os.close(write_end)
    return pid, read_end


def _code_file(code: str) -> int:
    """A memory file holding the code (UTF-8; lone surrogates kept), at its start: the
    interpreter's standard input. A file, not a pipe: the code is written whole before the
    fork, whatever its size, with no reader to wait for."""
    data = code.encode("utf-8", "surrogatepass")
    descriptor = os.memfd_create("python-tool-code")
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(descriptor, view):]
        os.lseek(descriptor, 0, os.SEEK_SET)
    except OSError:
        os.close(descriptor)
        raise
    return descriptor


def _execute(code_fd: int, output_fd: int, timeout_seconds: float, memory_mb: int) -> None:
    """The forked process: confine, become a fresh interpreter running the code (never
    returns)."""
    try:
        os.setpgid(0, 0)
        set_parent_death_signal()
        _redirect_output(code_fd, output_fd)
        binary, environment, keep = fresh_interpreter(_allowed_environment())
        confine_interpreter()  # uses descriptors the next step closes
        _close_inherited_descriptors(keep)
        _limit(resource.RLIMIT_AS, memory_mb << 20)
        _limit(resource.RLIMIT_CPU, math.ceil(timeout_seconds) + 1)
        # -u: output reaches the pipe in the order it was written (stdout, then the error)
        os.execve(binary, [binary, "-u", "-c", _RUNNER, str(memory_mb)], environment)
    except BaseException as error:  # no exec: say why where the caller reads
        os.write(2, f"error: the code could not be started ({error})\n".encode())
    finally:
        os._exit(1)


def _allowed_environment() -> dict[str, str]:
    environment = {name: os.environ[name] for name in ENVIRONMENT if name in os.environ}
    environment.setdefault("PATH", os.defpath)
    if "TMPDIR" in environment:
        environment["HOME"] = environment["TMPDIR"]
    return environment


def _redirect_output(code_fd: int, output_fd: int) -> None:
    """Standard input: the code (never the session's stdin); output and errors: the pipe."""
    os.dup2(code_fd, 0)
    os.close(code_fd)
    os.dup2(output_fd, 1)
    os.dup2(output_fd, 2)
    os.close(output_fd)


def _close_inherited_descriptors(keep: set[int]) -> None:
    """Close every descriptor above 2 but `keep` (which the new image inherits)."""
    for descriptor in keep:
        os.set_inheritable(descriptor, True)
    for name in os.listdir("/proc/self/fd"):
        descriptor = int(name)
        if descriptor > 2 and descriptor not in keep:
            try:
                os.close(descriptor)
            except OSError:  # the directory listing's own descriptor, closed already
                pass


def _limit(kind: int, value: int) -> None:
    """Lower both limits to `value` (never above the hard limit this process inherited)."""
    hard = resource.getrlimit(kind)[1]
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(kind, (value, value))


def _collect(pid: int, read_end: int, timeout_seconds: float,
             max_output_chars: int) -> tuple[str, bool]:
    """Read the process's output until it has exited and its pipe has closed, or the deadline.
    When it exits, what it started dies with it (its group is killed), so a child left running
    with the pipe open costs no wait. Returns (output text, whether the deadline passed)."""
    deadline = time.monotonic() + timeout_seconds
    kept, total_bytes = bytearray(), 0
    limit_bytes = 4 * max_output_chars  # enough bytes for max_output_chars UTF-8 characters
    exit_fd = os.pidfd_open(pid)
    pending = {read_end, exit_fd}
    try:
        while pending:
            remaining = deadline - time.monotonic()
            ready = select.select(list(pending), [], [], remaining)[0] if remaining > 0 else []
            if not ready:
                return _text(kept, total_bytes, max_output_chars), True
            if exit_fd in ready:
                pending.discard(exit_fd)
                _kill_group(pid)
            if read_end in ready:
                chunk = os.read(read_end, READ_CHUNK_BYTES)
                if not chunk:
                    pending.discard(read_end)
                total_bytes += len(chunk)
                kept += chunk[:max(0, limit_bytes - len(kept))]
    finally:
        os.close(exit_fd)
    return _text(kept, total_bytes, max_output_chars), False


def _kill_group(pid: int) -> None:
    """SIGKILL what is left of the process's group (the group outlives its leader until the
    leader is reaped)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _end(pid: int) -> int:
    """Kill what is left of the process's group and reap the process; its wait status."""
    _kill_group(pid)
    return os.waitpid(pid, 0)[1]


def _text(kept: bytearray, total_bytes: int, max_output_chars: int) -> str:
    text = kept.decode("utf-8", errors="replace")
    if len(text) <= max_output_chars and total_bytes == len(kept):
        return text
    return _join(text[:max_output_chars],
                 f"[output truncated to {max_output_chars} characters]")


def _join(output: str, note: str) -> str:
    return f"{output}\n{note}" if output and not output.endswith("\n") else output + note

"""Run a function on every rank of a real multi-process gloo world.

Each rank gets the environment torchrun would set (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT) and one thread. If any rank raises, the others are terminated and the test fails
with that rank's traceback; a world still running after `timeout` seconds is killed and the test
fails, so a hung job ends its test, not the suite.

Why a forkserver: a rank used to be a fresh interpreter (`spawn`) that imported torch,
Megatron-Core, transformers and vLLM itself, 5-12 s of CPU per rank. Ranks are now forked from
one server process per test session that imported those libraries once (`rank_preload.py`): a
world of two that initialises Megatron and shuts down takes under a second. Each rank still
imports the package and the test's worker module itself, and gets the test's environment,
working directory, `sys.path` and output as at the call, so it runs what a spawned rank ran
(docs/testing.md).
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_SECONDS = 900.0
"""A world still running after this long is killed and its test fails (the slowest world, an RL
learning curve with vLLM, takes about 3 minutes on 2 busy cores)."""

START_METHOD = os.environ.get("MCORE_RL_TEST_START_METHOD", "forkserver")
"""`spawn` gives every rank a fresh interpreter again (to compare, or to rule the server out)."""

# The server inherits this process's environment when it starts: one thread before torch loads.
os.environ.setdefault("OMP_NUM_THREADS", "1")
mp.set_forkserver_preload(["rank_preload"])


def free_port() -> int:
    """A free port below Linux's ephemeral range (32768-60999). A port the OS hands out (bind
    to 0) can be handed out again, to any connection opened before the world binds it: gloo
    opens many, so a port picked ahead for a later world could be gone by then."""
    generator = random.Random(os.getpid() * 1_000_003 + time.time_ns())
    for _ in range(200):
        port = generator.randrange(20000, 32768)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32767")


def _write_where_the_caller_writes(caller: int) -> None:
    """Point stdout and stderr at the caller's (a forked rank inherits the server's, which are
    those of the test that started it): a test reads its ranks' output as with spawn."""
    for fd in (1, 2):
        try:
            target = os.open(f"/proc/{caller}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        except OSError:  # a socket cannot be reopened: keep the server's
            continue
        os.dup2(target, fd)
        os.close(target)


def _entry(rank: int, world_size: int, port: int, caller: int, environment: dict, function,
           args, results: str) -> None:
    _write_where_the_caller_writes(caller)
    # A forked rank starts with the server's environment and caches: take the caller's, plus
    # what the preloaded imports set (as the rank's own imports would have).
    preloaded = sys.modules.get("rank_preload")
    os.environ.clear()
    os.environ.update(getattr(preloaded, "ADDED_ENVIRONMENT", {}))
    os.environ.update(environment)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    tempfile.tempdir = None
    torch.set_num_threads(1)
    from mcore_rl.runtime import quiet_known_warnings
    quiet_known_warnings()
    value = function(*args)
    path = os.path.join(results, f"rank_{rank}.pt")
    torch.save(value, path + ".partial")
    os.replace(path + ".partial", path)


def run_world(world_size: int, function, *args, timeout: float = DEFAULT_TIMEOUT_SECONDS
              ) -> list:
    """Call function(*args) on `world_size` processes forming one world and return what each
    rank returned, by rank (values travel through torch.save); raise the first rank's error,
    or TimeoutError once `timeout` seconds have passed."""
    with tempfile.TemporaryDirectory(prefix="world_results_") as results:
        context = mp.start_processes(
            _entry, args=(world_size, free_port(), os.getpid(), dict(os.environ), function,
                          args, results),
            nprocs=world_size, join=False, start_method=START_METHOD)
        try:
            _join(context, world_size, function, timeout)
        finally:  # a rank that raised wrote its traceback there; torch reads the first
            for path in context.error_files:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        return [torch.load(os.path.join(results, f"rank_{rank}.pt"), weights_only=False)
                for rank in range(world_size)]


def _join(context, world_size: int, function, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(0.0, min(5.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join()
            raise TimeoutError(f"a world of {world_size} running {function.__module__}."
                               f"{function.__qualname__} did not finish in {timeout:.0f} s")

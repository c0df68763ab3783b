"""Run a function on every rank of a real multi-process gloo world (torch.multiprocessing.spawn).

Each rank gets the environment torchrun would set (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT) and one thread. If any rank raises, spawn terminates the others and the test fails
with that rank's traceback instead of hanging.
"""

from __future__ import annotations

import os
import random
import socket
import time

import torch
import torch.multiprocessing as mp


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


def _entry(rank: int, world_size: int, port: int, function, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from mcore_rl.runtime import quiet_known_warnings
    quiet_known_warnings()
    function(*args)


def run_world(world_size: int, function, *args) -> None:
    """Call function(*args) on `world_size` fresh processes forming one world."""
    mp.start_processes(_entry, args=(world_size, free_port(), function, args),
                       nprocs=world_size, join=True, start_method="spawn")

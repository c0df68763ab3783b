"""Who am I in the world: rank, world size and rendezvous address from torchrun or SLURM.

torchrun sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT. `srun python -m mcore_rl ...`
(one task per rank, no torchrun) sets SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID instead; the
rendezvous address must then come from MASTER_ADDR/MASTER_PORT exported by the sbatch script.
A bare `python -m mcore_rl ...` is a world of one.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in the job, as the launcher described it."""

    rank: int
    """Global rank of this process."""

    world_size: int
    """Number of processes in the job."""

    local_rank: int
    """Rank among the processes of this node (selects the GPU)."""

    master_addr: str
    """Host of rank 0's rendezvous store."""

    master_port: int
    """Port of rank 0's rendezvous store."""

    launcher: str
    """Which launcher set the variables: torchrun, slurm or single."""

    ranks_per_node: int
    """Processes on each node (ranks are placed node by node): torchrun's LOCAL_WORLD_SIZE,
    the first count of SLURM_TASKS_PER_NODE, else the whole world."""


def _int(environ: Mapping[str, str], name: str) -> int:
    value = environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer") from None


def _slurm_tasks_per_node(environ: Mapping[str, str], world: int) -> int:
    """The first node's task count from SLURM_TASKS_PER_NODE ("4(x2)", "4,4" or "4")."""
    value = environ.get("SLURM_TASKS_PER_NODE", "")
    match = re.match(r"\d+", value)
    return int(match.group()) if match else world


def read_launch_env(environ: Mapping[str, str] = os.environ) -> LaunchEnv:
    """Read the launcher's variables; torchrun's take precedence over SLURM's."""
    addr = environ.get("MASTER_ADDR", "127.0.0.1")
    port = _int(environ, "MASTER_PORT") if "MASTER_PORT" in environ else 29500
    if "RANK" in environ and "WORLD_SIZE" in environ:
        world = _int(environ, "WORLD_SIZE")
        return LaunchEnv(_int(environ, "RANK"), world,
                         _int(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else 0,
                         addr, port, "torchrun",
                         _int(environ, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in environ
                         else world)
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        world = _int(environ, "SLURM_NTASKS")
        if world > 1 and "MASTER_ADDR" not in environ:
            raise ValueError("running under srun with SLURM_NTASKS>1 but MASTER_ADDR is not set: "
                             "export MASTER_ADDR (the first node of the allocation) and "
                             "MASTER_PORT in the sbatch script, or launch with torchrun")
        return LaunchEnv(_int(environ, "SLURM_PROCID"), world,
                         _int(environ, "SLURM_LOCALID") if "SLURM_LOCALID" in environ else 0,
                         addr, port, "slurm", _slurm_tasks_per_node(environ, world))
    # One process alone: its own store needs no agreed port, and a fixed one would collide with
    # any other job on the machine (two conversions at once).
    if "MASTER_PORT" not in environ:
        port = _free_port(addr)
    return LaunchEnv(0, 1, 0, addr, port, "single", 1)


def _free_port(addr: str) -> int:
    with socket.socket() as sock:
        sock.bind((addr, 0))
        return sock.getsockname()[1]

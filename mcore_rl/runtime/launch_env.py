"""Who am I in the world: rank, world size and rendezvous address from torchrun or SLURM.

torchrun sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT. `srun python -m mcore_rl ...`
(one task per rank, no torchrun) sets SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID instead; the
rendezvous address must then come from MASTER_ADDR/MASTER_PORT exported by the sbatch script.
A bare `python -m mcore_rl ...` is a world of one.
"""

from __future__ import annotations

import os
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


def _int(environ: Mapping[str, str], name: str) -> int:
    value = environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer") from None


def read_launch_env(environ: Mapping[str, str] = os.environ) -> LaunchEnv:
    """Read the launcher's variables; torchrun's take precedence over SLURM's."""
    addr = environ.get("MASTER_ADDR", "127.0.0.1")
    port = _int(environ, "MASTER_PORT") if "MASTER_PORT" in environ else 29500
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return LaunchEnv(_int(environ, "RANK"), _int(environ, "WORLD_SIZE"),
                         _int(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else 0,
                         addr, port, "torchrun")
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        world = _int(environ, "SLURM_NTASKS")
        if world > 1 and "MASTER_ADDR" not in environ:
            raise ValueError("running under srun with SLURM_NTASKS>1 but MASTER_ADDR is not set: "
                             "export MASTER_ADDR (the first node of the allocation) and "
                             "MASTER_PORT in the sbatch script, or launch with torchrun")
        return LaunchEnv(_int(environ, "SLURM_PROCID"), world,
                         _int(environ, "SLURM_LOCALID") if "SLURM_LOCALID" in environ else 0,
                         addr, port, "slurm")
    return LaunchEnv(0, 1, 0, addr, port, "single")

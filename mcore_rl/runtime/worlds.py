"""Split placement: the job's ranks as two worlds (trainers, rollout engines) and a bridge.

Megatron-Core builds its tensor/pipeline/data-parallel groups over the whole default world
(`initialize_model_parallel` has no rank offset), and vLLM's external-launcher executor takes
the default world as its own. So when the last `rollout_ranks` ranks of a job only generate,
each rank set gets a default world of its own: the trainer ranks 0..T-1 (Megatron sees a
world of T) and the rollout ranks T..T+R-1 (vLLM sees a world of R, ranks renumbered from 0).
Both are created on one rendezvous store under different prefixes, as are two groups over all
ranks in job order: the bridge, through which weights go from trainers to engines
(runtime/transport.py), and a gloo group for Python objects (runtime/messages.py). Every group
carries the collective timeout, so a rank that dies on one side ends the other side's waits
with an error instead of a hang.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .launch_env import LaunchEnv
from .log import set_job_rank
from .messages import FailureNotice
from .transport import BridgeTransport


@dataclass(frozen=True)
class SplitWorld:
    """This rank's place in split placement."""

    side: str
    """"trainer" or "rollout"."""

    job: LaunchEnv
    """The job as the launcher started it (job rank and size)."""

    launch: LaunchEnv
    """This side's own world: rank within the side, the side's size."""

    bridge: BridgeTransport
    """All ranks of the job, in job order: the trainers first, then the rollout ranks. Carries
    the weights (NCCL on GPUs)."""

    messages: dist.ProcessGroup
    """A gloo group over all ranks of the job, in job order: Python objects (batches, metrics)
    from rollout ranks to trainer ranks, in host memory, never queued behind weights."""

    store: dist.Store
    """The job's rendezvous store, for small control messages between the sides."""

    side_group: dist.ProcessGroup
    """A gloo group over this side's world, for its Python-object collectives."""

    failure: FailureNotice
    """Where a failing rank leaves its error for the other side, which looks there while it
    waits for a message or an agreement from that side."""


def side_of(job: LaunchEnv, rollout_ranks: int) -> tuple[str, LaunchEnv]:
    """Which side job rank `job.rank` is on, and that side's world as a LaunchEnv."""
    trainer_ranks = job.world_size - rollout_ranks
    if not 0 < rollout_ranks < job.world_size:
        raise ValueError(f"placement.rollout_ranks={rollout_ranks} must leave at least one "
                         f"trainer rank and one rollout rank in a world of {job.world_size}")
    if job.rank < trainer_ranks:
        return "trainer", dataclasses.replace(job, world_size=trainer_ranks)
    return "rollout", dataclasses.replace(job, rank=job.rank - trainer_ranks,
                                          world_size=rollout_ranks)


def start_split_worlds(job: LaunchEnv, rollout_ranks: int, backend: str,
                       timeout: datetime.timedelta) -> SplitWorld:
    """Create this rank's side world (the default process group) and the bridge; every rank
    of the job must call it. The caller picks and sets the device first."""
    side, launch = side_of(job, rollout_ranks)
    store, _, _ = next(dist.rendezvous(
        f"tcp://{job.master_addr}:{job.master_port}?rank={job.rank}&world_size={job.world_size}",
        timeout=timeout))
    device_id = (torch.device("cuda", torch.cuda.current_device())
                 if backend == "nccl" else None)
    dist.init_process_group(backend, store=dist.PrefixStore(f"mcore_rl/{side}", store),
                            rank=launch.rank, world_size=launch.world_size, timeout=timeout,
                            device_id=device_id)
    control_store = dist.PrefixStore("mcore_rl/control", store)
    failure = FailureNotice(control_store, timeout)
    bridge_store = dist.PrefixStore("mcore_rl/bridge", store)
    bridge = BridgeTransport(_bridge_group(backend, bridge_store, job, timeout), bridge_store,
                             failure)
    messages = _bridge_group("gloo", dist.PrefixStore("mcore_rl/messages", store), job, timeout)
    side_group = dist.new_group(backend="gloo", timeout=timeout)
    set_job_rank(job.rank)
    return SplitWorld(side, job, launch, bridge, messages, control_store, side_group, failure)


def _bridge_group(backend: str, store: dist.Store, job: LaunchEnv,
                  timeout: datetime.timedelta):
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, job.rank, job.world_size, options)
    return dist.ProcessGroupGloo(store, job.rank, job.world_size, timeout)

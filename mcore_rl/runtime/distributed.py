"""Start-up and shutdown of every rank: process group, Megatron parallel state, seeds.

Every rank calls `initialize()` with the same validated config (SPMD: no driver process). It
picks NCCL with CUDA and gloo without, applies the CPU compatibility layer only when CUDA is
absent, sets a timeout on every process group so that a dead or stuck rank turns into an error
on the others instead of a hang, and seeds Python, NumPy, torch and Megatron's RNG tracker.
"""

from __future__ import annotations

import datetime
import os
import random
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist

from ..config import JobConfig, validate
from .devices import cuda_device_index
from .launch_env import LaunchEnv, read_launch_env
from .layout import ParallelLayout
from .log import forget_job_rank, quiet_known_warnings, send_library_logs_to_file
from .model_rank import ModelRank
from .process_guard import guard_this_rank, reclaim_stale_files
from .training_groups import destroy_training_groups, initialize_training_groups
from .worlds import SplitWorld, start_split_worlds


@dataclass(frozen=True)
class Runtime:
    """What a rank knows about the started world."""

    launch: LaunchEnv
    """Rank, world size and rendezvous as the launcher set them."""

    backend: str
    """torch.distributed backend in use (nccl or gloo)."""

    device: torch.device
    """Device this rank computes on."""

    split: SplitWorld | None = None
    """Split placement: this rank's side, its side's world and the bridge between the sides
    (None when colocated: `launch` is then this rank's only world)."""

    training: ModelRank | None = None
    """This rank in the trained models' layout (actor, critic, reference), with their groups;
    None on split placement's rollout ranks and in jobs without Megatron models."""

    @property
    def side(self) -> str:
        """"trainer" or "rollout" in split placement; "colocated" otherwise."""
        return self.split.side if self.split is not None else "colocated"

    @property
    def rank(self) -> int:
        return self.launch.rank

    @property
    def world_size(self) -> int:
        return self.launch.world_size


def choose_backend(requested: str) -> str:
    """nccl with CUDA, gloo without, unless the config names one."""
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def initialize(config: JobConfig, launch: LaunchEnv | None = None) -> Runtime:
    """Validate the config for this world, then start torch.distributed, Megatron's parallel
    state and the RNGs. Raises if a process group already exists."""
    quiet_known_warnings()
    launch = launch or read_launch_env()
    validate(config, launch.world_size)
    log_file = send_library_logs_to_file(config.runtime.output_dir, launch.rank)
    if log_file and launch.rank == 0:
        print(f"library logs (vLLM, Megatron, transformers): {os.path.dirname(log_file)}/ "
              f"(MCORE_RL_LIBRARY_LOGS=console shows them here)", flush=True)
    if config.placement.split:
        runtime = start_split_process_groups(config.placement.rollout_ranks,
                                             config.runtime.backend,
                                             config.runtime.collective_timeout_minutes, launch)
    else:
        runtime = start_process_group(config.runtime.backend,
                                      config.runtime.collective_timeout_minutes, launch)
    if runtime.side == "rollout":  # no Megatron model here: the engine is vLLM
        seed_host_generators(config.runtime.seed)
        return runtime
    layout = ParallelLayout.of(config.parallel, dist.get_world_size())
    training = initialize_training_groups(layout, config.runtime.collective_timeout_minutes)
    seed_everything(config.runtime.seed)
    return replace(runtime, training=training)


def start_process_group(backend: str = "auto", timeout_minutes: float = 10.0,
                        launch: LaunchEnv | None = None) -> Runtime:
    """torch.distributed only (no Megatron model-parallel state), for jobs such as checkpoint
    conversion. Applies the CPU compatibility layer when CUDA is absent."""
    launch = launch or read_launch_env()
    device = _prepare_device(launch)
    backend = choose_backend(backend)
    _export_launch_variables(launch)
    dist.init_process_group(backend=backend, init_method=f"tcp://{launch.master_addr}:"
                            f"{launch.master_port}", rank=launch.rank,
                            world_size=launch.world_size,
                            timeout=datetime.timedelta(minutes=timeout_minutes),
                            device_id=device if device.type == "cuda" else None)
    return Runtime(launch=launch, backend=backend, device=device)


def start_split_process_groups(rollout_ranks: int, backend: str = "auto",
                               timeout_minutes: float = 10.0,
                               launch: LaunchEnv | None = None) -> Runtime:
    """Split placement (runtime.worlds): this rank's side world as the default process group,
    and the bridge to the other side. The side's rank and size are exported as RANK and
    WORLD_SIZE for the libraries inside the side (vLLM's external launcher reads them)."""
    launch = launch or read_launch_env()
    device = _prepare_device(launch)
    backend = choose_backend(backend)
    _export_launch_variables(launch)
    split = start_split_worlds(launch, rollout_ranks, backend,
                               datetime.timedelta(minutes=timeout_minutes))
    os.environ.update(RANK=str(split.launch.rank), WORLD_SIZE=str(split.launch.world_size))
    return Runtime(launch=launch, backend=backend, device=device, split=split)


def _prepare_device(launch: LaunchEnv) -> torch.device:
    """This rank's device, selected; the CPU compatibility layer applied when there is no GPU."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized; call shutdown() first")
    _guard_rank(launch)
    if not torch.cuda.is_available():
        from . import cpu_compat
        cpu_compat.apply()
        return torch.device("cpu")
    device = torch.device("cuda", cuda_device_index(launch.local_rank, torch.cuda.device_count()))
    torch.cuda.set_device(device)
    return device


def _guard_rank(launch: LaunchEnv) -> None:
    """Nothing this rank starts outlives it (runtime.process_guard); the first rank of each
    machine first removes what killed runs left there."""
    if launch.local_rank == 0:
        removed = reclaim_stale_files()
        if removed:
            print(f"removed {len(removed)} file(s) left by killed runs that no live process "
                  f"uses: {', '.join(removed)}", flush=True)
    guard_this_rank()


def _export_launch_variables(launch: LaunchEnv) -> None:
    """Set torchrun's variables when srun or a bare `python` started this rank: libraries
    running inside the job read them (vLLM's external-launcher executor needs RANK)."""
    for name, value in (("RANK", launch.rank), ("WORLD_SIZE", launch.world_size),
                        ("LOCAL_RANK", launch.local_rank), ("MASTER_ADDR", launch.master_addr),
                        ("MASTER_PORT", launch.master_port)):
        os.environ.setdefault(name, str(value))


def seed_everything(seed: int) -> None:
    """Seed every generator. Megatron's tracker gets seed (data-parallel stream) and
    seed + 2718 + tp_rank (tensor-parallel stream), so TP ranks draw different dropout masks."""
    from megatron.core import tensor_parallel

    seed_host_generators(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def seed_host_generators(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (no Megatron tracker)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def shutdown() -> None:
    """Tear down Megatron's groups and the process group after a successful run (safe to call
    twice). Not for error paths: its barrier would wait for ranks stuck elsewhere; a failing
    rank should just raise, and the launcher ends the others."""
    destroy_training_groups()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    forget_job_rank()


"""Where tensors live: the device rules of the GPU path, each decided in one place.

On a GPU machine a tensor built without `device=` is in host memory, and handing it to a CUDA
model, mixing it into an op with CUDA tensors or giving it to an NCCL collective fails. On the
CPU machines CI runs on everything is host memory, so these bugs pass silently there (the
device-discipline test makes them visible). The rules:

- Batches live where their builder put them (the trainer builds them in host memory). A role
  moves each micro-batch to its model's device inside the schedule (`to_device`) and returns
  per-token outputs on the device of the batch it was given.
- A collective's tensors live on its group's device (`collective_device`): the GPU for NCCL,
  the CPU for gloo.
- Each rank computes on one GPU, chosen from the GPUs visible to it (`cuda_device_index`).
"""

from __future__ import annotations

import os
from typing import Mapping

import torch
import torch.distributed as dist


def collective_device(group=None) -> torch.device:
    """Where tensors for a collective over `group` (None: the world) must live."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def module_device(module: torch.nn.Module) -> torch.device:
    """The device of a model's (first) parameter: where its inputs must go."""
    return next(module.parameters()).device


def to_device(batch: Mapping[str, torch.Tensor], device: torch.device) -> dict:
    """The batch's tensors on `device` (no copy for those already there)."""
    return {name: tensor.to(device, non_blocking=True) for name, tensor in batch.items()}


def cuda_device_index(local_rank: int, visible_gpus: int) -> int:
    """The GPU this rank computes on, among the `visible_gpus` it sees. One visible GPU is
    this rank's own whatever its local rank (SLURM's --gpus-per-task=1 binding, or a
    container given one GPU); with several, the local rank picks one (torchrun's layout)."""
    if visible_gpus < 1:
        raise RuntimeError("CUDA is available but no GPU is visible to this process "
                           "(CUDA_VISIBLE_DEVICES?)")
    if visible_gpus == 1:
        return 0
    if local_rank >= visible_gpus:
        raise RuntimeError(f"local rank {local_rank} has no GPU of its own: {visible_gpus} are "
                           f"visible to it (CUDA_VISIBLE_DEVICES); start at most {visible_gpus} "
                           "ranks per node, or bind one GPU per task (srun --gpus-per-task=1)")
    return local_rank


def device_memory_bytes(device: torch.device) -> int:
    """The memory one rank's models live in: the GPU's, or on a CPU the machine's physical
    memory shared by the ranks of this machine (LOCAL_WORLD_SIZE, as torchrun sets it)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return physical // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))

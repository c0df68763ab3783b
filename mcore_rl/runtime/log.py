"""Console output for SPMD jobs: rank-0 printing and silencing warnings every rank repeats."""

from __future__ import annotations

import resource
import warnings

import torch
import torch.distributed as dist

# Megatron-Core announces every optional fused kernel it falls back from, on every rank.
KNOWN_WARNINGS = (
    "Apex is not installed",
    "Transformer Engine and Apex are not installed",
    "full scope is deprecated",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    # Megatron's distributed optimizer probes .grad on its fp32 shard views.
    "is not a leaf Tensor is being accessed",
    # torch 2.13 renamed the collectives Megatron's buffers call.
    "is deprecated. Please use `torch.distributed",
    # Megatron 0.16 calls torch.distributed.checkpoint.load_state_dict.
    "`load_state_dict` is deprecated",
)


def quiet_known_warnings() -> None:
    """Hide the harmless warnings listed in KNOWN_WARNINGS (idempotent)."""
    for text in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=f".*{text}.*")


def is_rank0() -> bool:
    """True on global rank 0 or outside a distributed job."""
    return not dist.is_initialized() or dist.get_rank() == 0


def print0(*args, **kwargs) -> None:
    """print() on global rank 0 only, flushed (logs of many ranks stay readable)."""
    if is_rank0():
        print(*args, **kwargs, flush=True)


def peak_resident_mb() -> float:
    """Peak resident memory (MB) of this process, or the largest over all ranks (collective)."""
    from .devices import collective_device

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    if not dist.is_initialized():
        return peak
    holder = torch.tensor([peak], device=collective_device())
    dist.all_reduce(holder, op=dist.ReduceOp.MAX)
    return float(holder)

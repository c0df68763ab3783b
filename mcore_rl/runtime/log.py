"""Console output for SPMD jobs: rank-0 printing, silencing warnings every rank repeats, and
the libraries' own logs (vLLM, Megatron, transformers) sent to per-rank files.

A job's console is for its user: phases, per-step metrics, progress, errors. vLLM alone logs
hundreds of INFO lines per run (and warnings about CPU thread binding and tcmalloc that need no
action here), on every rank. Those records go to RUN_DIR/logs/rank_<N>.log instead; errors
still reach the console. MCORE_RL_LIBRARY_LOGS=console keeps everything on the console.
"""

from __future__ import annotations

import logging
import os
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


LIBRARY_LOGGERS = ("vllm", "megatron", "transformers", "urllib3", "filelock")
"""Third-party loggers whose records go to the per-rank log file (torch's own are governed by
TORCH_LOGS and stay as they are)."""

LIBRARY_LOGS_ENV = "MCORE_RL_LIBRARY_LOGS"
"""Set to `console` to leave the libraries' logs on the console."""

LOGS_DIR = "logs"


def send_library_logs_to_file(output_dir: str, rank: int) -> str | None:
    """Route LIBRARY_LOGGERS (INFO and up) into output_dir/logs/rank_<rank>.log, ERROR and up
    also to the console; returns the file's path (None with MCORE_RL_LIBRARY_LOGS=console).
    Call before vLLM is imported: it would install a console handler of its own."""
    if os.environ.get(LIBRARY_LOGS_ENV, "").lower() == "console":
        return None
    os.environ["VLLM_CONFIGURE_LOGGING"] = "0"
    path = os.path.join(output_dir, LOGS_DIR, f"rank_{rank:05d}.log")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    to_file = logging.FileHandler(path, encoding="utf-8")
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    to_console = logging.StreamHandler()
    to_console.setLevel(logging.ERROR)
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers[:] = [to_file, to_console]
        logger.propagate = False
        logger.setLevel(logging.INFO)
    return path


_job_rank: int | None = None
"""The rank in the whole job when the default process group is only one side of it (split
placement: trainer ranks and rollout ranks each have their own world)."""


def set_job_rank(rank: int) -> None:
    """Make `is_rank0` answer for the job, not the side world (runtime.worlds calls it)."""
    global _job_rank
    _job_rank = rank


def forget_job_rank() -> None:
    global _job_rank
    _job_rank = None


def job_rank() -> int:
    """This process's rank in the whole job (0 outside a distributed job)."""
    if _job_rank is not None:
        return _job_rank
    return dist.get_rank() if dist.is_initialized() else 0


def is_rank0() -> bool:
    """True on the job's rank 0 or outside a distributed job."""
    return job_rank() == 0


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

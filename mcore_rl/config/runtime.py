"""Process-level settings: backend, timeouts, seeds, output locations."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .training import PRECISIONS

AUTO_PRECISION = "auto"


def resolve_precision(precision: str) -> str:
    """`auto` settled for this machine: bf16 where CUDA is present, fp32 without (CPU runs
    stay exact for the tests); any other value unchanged."""
    if precision != AUTO_PRECISION:
        return precision
    import torch

    return "bf16" if torch.cuda.is_available() else "fp32"


@dataclass(frozen=True)
class RuntimeConfig:
    """How every rank of the job starts, computes and fails."""

    seed: int = 1234
    """Seed for Python, NumPy and torch; Megatron derives its TP/EP RNG streams from it."""

    precision: str = AUTO_PRECISION
    """Parameter and compute dtype: auto (bf16 where CUDA is present, fp32 without), fp32,
    bf16 or fp16 (the 16-bit ones with fp32 master weights)."""

    collective_timeout_minutes: float = 10.0
    """A collective that waits longer than this fails the job instead of hanging it."""

    backend: str = "auto"
    """torch.distributed backend: auto (nccl with CUDA, gloo without), nccl or gloo."""

    output_dir: str = "runs/default"
    """Directory for logs, TensorBoard events and checkpoints of this run."""

    def check(self) -> list[str]:
        """Broken rules as messages naming the field (empty when valid)."""
        errors = []
        if self.precision not in (AUTO_PRECISION, *PRECISIONS):
            errors.append(f"runtime.precision={self.precision!r} must be one of "
                          f"{', '.join((AUTO_PRECISION, *PRECISIONS))}")
        if self.backend not in ("auto", "nccl", "gloo"):
            errors.append(f"runtime.backend={self.backend!r} must be auto, nccl or gloo")
        if self.collective_timeout_minutes <= 0:
            errors.append("runtime.collective_timeout_minutes must be > 0")
        return errors

    def resolved(self) -> "RuntimeConfig":
        """This config with machine-dependent settings (`auto` precision) settled."""
        return dataclasses.replace(self, precision=resolve_precision(self.precision))

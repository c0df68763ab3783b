"""Process-level settings: backend, timeouts, seeds, output locations."""

from __future__ import annotations

from dataclasses import dataclass

from .training import PRECISIONS


@dataclass(frozen=True)
class RuntimeConfig:
    """How every rank of the job starts, computes and fails."""

    seed: int = 1234
    """Seed for Python, NumPy and torch; Megatron derives its TP/EP RNG streams from it."""

    precision: str = "fp32"
    """Parameter and compute dtype: fp32, bf16 or fp16 (mixed precision with fp32 master weights)."""

    collective_timeout_minutes: float = 10.0
    """A collective that waits longer than this fails the job instead of hanging it."""

    backend: str = "auto"
    """torch.distributed backend: auto (nccl with CUDA, gloo without), nccl or gloo."""

    output_dir: str = "runs/default"
    """Directory for logs, TensorBoard events and checkpoints of this run."""

    def check(self) -> list[str]:
        """Broken rules as messages naming the field (empty when valid)."""
        errors = []
        if self.precision not in PRECISIONS:
            errors.append(f"runtime.precision={self.precision!r} must be one of "
                          f"{', '.join(PRECISIONS)}")
        if self.backend not in ("auto", "nccl", "gloo"):
            errors.append(f"runtime.backend={self.backend!r} must be auto, nccl or gloo")
        if self.collective_timeout_minutes <= 0:
            errors.append("runtime.collective_timeout_minutes must be > 0")
        return errors

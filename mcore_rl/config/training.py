"""Optimisation settings shared by every trained role (actor, critic)."""

from __future__ import annotations

from dataclasses import dataclass

PRECISIONS = ("fp32", "bf16", "fp16")
LR_DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class OptimizerConfig:
    """Adam with Megatron's distributed optimizer, gradient clipping and an LR schedule."""

    lr: float = 1e-5
    """Peak learning rate."""

    min_lr: float = 0.0
    """Learning rate at the end of the decay."""

    lr_warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to `lr`."""

    lr_decay_steps: int = 0
    """Optimizer steps over which the LR decays to `min_lr` after warm-up (0: no decay)."""

    lr_decay_style: str = "constant"
    """Shape of the decay: constant, linear or cosine."""

    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay."""

    adam_beta1: float = 0.9
    """Adam first-moment decay."""

    adam_beta2: float = 0.999
    """Adam second-moment decay."""

    adam_eps: float = 1e-8
    """Adam denominator epsilon."""

    clip_grad: float = 1.0
    """Global gradient-norm clipping threshold (0 disables clipping)."""

    use_distributed_optimizer: bool = True
    """Shard optimizer state and fp32 master weights over data-parallel ranks (ZeRO-1)."""

    def check(self, prefix: str) -> list[str]:
        """Broken rules as messages naming the field under `prefix` (empty when valid)."""
        errors = []
        if self.lr < 0 or self.min_lr < 0:
            errors.append(f"{prefix}.lr and {prefix}.min_lr must be >= 0")
        if self.min_lr > self.lr:
            errors.append(f"{prefix}.min_lr={self.min_lr} must not exceed {prefix}.lr={self.lr}")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            errors.append(f"{prefix}.lr_decay_style={self.lr_decay_style!r} must be one of "
                          f"{', '.join(LR_DECAY_STYLES)}")
        if self.lr_warmup_steps < 0 or self.lr_decay_steps < 0:
            errors.append(f"{prefix}.lr_warmup_steps and {prefix}.lr_decay_steps must be >= 0")
        if not 0 <= self.adam_beta1 < 1 or not 0 <= self.adam_beta2 < 1:
            errors.append(f"{prefix}.adam_beta1 and {prefix}.adam_beta2 must be in [0, 1)")
        if self.clip_grad < 0:
            errors.append(f"{prefix}.clip_grad={self.clip_grad} must be >= 0")
        return errors


@dataclass(frozen=True)
class BatchConfig:
    """How many sequences make one optimizer step and how they are cut into micro-batches."""

    global_batch_size: int = 8
    """Sequences per optimizer step, summed over all data-parallel ranks."""

    micro_batch_size: int = 2
    """Sequences per forward/backward pass on one rank (pipeline micro-batch)."""

    seq_length: int = 64
    """Maximum tokens per sequence; batches are right-padded up to the longest sequence."""

    def micro_batches_per_rank(self, data_parallel_size: int) -> int:
        """Micro-batches each data-parallel rank runs per optimizer step."""
        return self.global_batch_size // (self.micro_batch_size * data_parallel_size)

    def check(self, data_parallel_size: int, prefix: str = "batch") -> list[str]:
        """Broken rules as messages naming the field (empty when valid)."""
        errors = []
        for name in ("global_batch_size", "micro_batch_size", "seq_length"):
            if getattr(self, name) < 1:
                errors.append(f"{prefix}.{name}={getattr(self, name)} must be >= 1")
        if errors:
            return errors
        per_step = self.micro_batch_size * data_parallel_size
        if self.global_batch_size % per_step:
            errors.append(
                f"{prefix}.global_batch_size={self.global_batch_size} must be divisible by "
                f"{prefix}.micro_batch_size x data-parallel size = {self.micro_batch_size} x "
                f"{data_parallel_size} = {per_step}")
        return errors

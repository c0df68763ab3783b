"""The root configuration of one mcore_rl job and its single validation entry point."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .model import ModelConfig
from .parallel import ParallelConfig
from .runtime import RuntimeConfig
from .training import BatchConfig, OptimizerConfig


class ConfigError(ValueError):
    """A configuration that breaks one or more rules; the message lists every broken rule."""


@dataclass(frozen=True)
class InitConfig:
    """Where the model's starting weights come from (random initialisation when both are unset).
    Either source also defines the architecture: the `model` section must then stay unset."""

    hf_path: Optional[str] = None
    """An HF checkpoint folder (config.json + safetensors), read directly, no offline step."""

    checkpoint: Optional[str] = None
    """An mcore_rl weights checkpoint (`mcore-rl convert hf-to-mcore` or a training save)."""


@dataclass(frozen=True)
class SmokeConfig:
    """The distributed forward/backward smoke job (`mcore-rl smoke`)."""

    steps: int = 3
    """Optimizer steps to run on random tokens."""


@dataclass(frozen=True)
class JobConfig:
    """Everything one job needs; every rank builds the same one from the same YAML and overrides."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Architecture of the trained model."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Training layout over the world."""

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and learning-rate schedule."""

    batch: BatchConfig = field(default_factory=BatchConfig)
    """Global and micro batch sizes and sequence length."""

    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    """Backend, precision, seeds, timeouts and output directory."""

    init: InitConfig = field(default_factory=InitConfig)
    """Starting weights (and with them the architecture)."""

    smoke: SmokeConfig = field(default_factory=SmokeConfig)
    """Settings of the smoke job."""


def validate(config: JobConfig, world_size: int) -> JobConfig:
    """Check every rule that can be checked before a process group exists; raise ConfigError
    listing all broken ones (not just the first). Returns the config unchanged."""
    parallel = config.parallel
    errors = parallel.check(world_size)
    errors += config.model.check(parallel.tensor_model_parallel_size,
                                 parallel.pipeline_model_parallel_size)
    errors += config.optimizer.check("optimizer")
    errors += config.runtime.check()
    if not errors:
        errors += config.batch.check(parallel.data_parallel_size(world_size))
        if config.batch.seq_length > config.model.max_position_embeddings:
            errors.append(f"batch.seq_length={config.batch.seq_length} exceeds "
                          f"model.max_position_embeddings={config.model.max_position_embeddings}")
    if config.init.hf_path and config.init.checkpoint:
        errors.append("set at most one of init.hf_path and init.checkpoint")
    if config.smoke.steps < 1:
        errors.append(f"smoke.steps={config.smoke.steps} must be >= 1")
    if errors:
        raise ConfigError("invalid configuration (world size %d):\n  - %s"
                          % (world_size, "\n  - ".join(errors)))
    return config

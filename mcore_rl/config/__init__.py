"""Typed, frozen configuration: dataclasses with a docstring per field, YAML + overrides, validate()."""

from .algorithm import AlgorithmConfig
from .job import ConfigError, InitConfig, JobConfig, SmokeConfig, validate, validate_sft
from .load import load_config, to_yaml
from .model import ModelConfig, MoEConfig, RopeScalingConfig
from .parallel import ParallelConfig
from .rl_validation import validate_rl
from .runtime import RuntimeConfig
from .sft import SftConfig
from .training import BatchConfig, OptimizerConfig

__all__ = ["AlgorithmConfig", "BatchConfig", "ConfigError", "InitConfig", "JobConfig", "ModelConfig",
           "MoEConfig", "OptimizerConfig",
           "ParallelConfig", "RopeScalingConfig", "RuntimeConfig", "SftConfig", "SmokeConfig", "load_config",
           "to_yaml", "validate", "validate_rl", "validate_sft"]

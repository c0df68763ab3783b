"""The model's architecture from the job's starting weights.

When init.hf_path or init.checkpoint is set, the architecture is read from there, so the YAML
never repeats (and can never contradict) it. This lives above config and below every job: the
config stays plain data, and each job (RL, SFT, smoke) resolves its model once, first thing.
"""

from __future__ import annotations

import dataclasses

from mcore_rl.checkpoint.weights_io import read_metadata
from mcore_rl.config import ConfigError, InitConfig, JobConfig, ModelConfig

from .hf_to_mcore import model_config_of_hf


def with_model_from_init(config: JobConfig) -> JobConfig:
    """The config with `model` read from init.hf_path or init.checkpoint (unchanged without
    either). A `model` section that differs from the source's is refused; one equal to it (a
    config resolved before) is accepted."""
    source = config.init.hf_path or config.init.checkpoint
    if not source:
        return config
    model = model_of_init(config.init, "init")
    if config.model not in (ModelConfig(), model):
        raise ConfigError(f"the model comes from {source}: remove the 'model' section "
                          "(and model.* overrides) from the config")
    return dataclasses.replace(config, model=model)


def model_of_init(init: InitConfig, field: str) -> ModelConfig:
    """The architecture `init` (an HF folder or an mcore_rl checkpoint) holds; ConfigError
    naming `field` when it cannot be read."""
    try:
        if init.hf_path:
            return model_config_of_hf(init.hf_path)
        return read_metadata(init.checkpoint)["model"]
    except (OSError, ValueError) as error:
        raise ConfigError(f"{field}: {error}") from error

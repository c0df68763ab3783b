"""The model's architecture from the job's starting weights.

When init.hf_path or init.checkpoint is set, the architecture is read from there, so the YAML
never repeats (and can never contradict) it. This lives above config and below every job: the
config stays plain data, and each job (RL, SFT, smoke) resolves its model once, first thing.
"""

from __future__ import annotations

import dataclasses

from mcore_rl.checkpoint.weights_io import read_metadata
from mcore_rl.config import ConfigError, JobConfig, ModelConfig

from .hf_to_mcore import model_config_of_hf


def with_model_from_init(config: JobConfig) -> JobConfig:
    """The config with `model` read from init.hf_path or init.checkpoint (unchanged without
    either). A `model` section that differs from the source's is refused; one equal to it (a
    config resolved before) is accepted."""
    source = config.init.hf_path or config.init.checkpoint
    if not source:
        return config
    try:
        if config.init.hf_path:
            model = model_config_of_hf(config.init.hf_path)
        else:
            model = read_metadata(config.init.checkpoint)["model"]
    except (OSError, ValueError) as error:
        raise ConfigError(f"init: {error}") from error
    if config.model not in (ModelConfig(), model):
        raise ConfigError(f"the model comes from {source}: remove the 'model' section "
                          "(and model.* overrides) from the config")
    return dataclasses.replace(config, model=model)

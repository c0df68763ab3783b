"""YAML files plus dotted command-line overrides -> a typed, frozen JobConfig.

OmegaConf does the merging and the type checks against the dataclass schema, so an unknown key
or a wrong type fails with the full dotted key before anything starts. YAML files may list
others under `defaults:` (paths relative to the including file), merged first.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterable

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .job import ConfigError, JobConfig
from .model import ModelConfig


def _read_yaml(path: str, seen: tuple[str, ...] = ()) -> "OmegaConf":
    path = os.path.abspath(path)
    if path in seen:
        raise ConfigError(f"{path}: 'defaults' include cycle through {' -> '.join(seen)}")
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    try:
        node = OmegaConf.load(path)
    except Exception as error:  # yaml.YAMLError and friends
        raise ConfigError(f"{path}: not valid YAML: {error}") from error
    defaults = node.pop("defaults", []) if OmegaConf.is_dict(node) else []
    merged = OmegaConf.create()
    for include in defaults:
        merged = OmegaConf.merge(
            merged, _read_yaml(os.path.join(os.path.dirname(path), str(include)), seen + (path,)))
    return OmegaConf.merge(merged, node)


def _describe(error: OmegaConfBaseException, source: str) -> str:
    key = getattr(error, "full_key", None)
    message = str(error).splitlines()[0]
    return f"{source}: key '{key}': {message}" if key else f"{source}: {message}"


def load_config(path: str | None = None, overrides: Iterable[str] = ()) -> JobConfig:
    """Build the JobConfig from defaults, then the YAML file (if any), then `key=value` overrides
    (values parsed as YAML: `optimizer.lr=1e-4`, `model.tie_embeddings=true`)."""
    schema = OmegaConf.structured(JobConfig)
    sources = [("defaults", schema)]
    if path:
        sources.append((path, _read_yaml(path)))
    overrides = list(overrides)
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} must look like key.path=value")
    if overrides:
        sources.append(("command line", OmegaConf.from_dotlist(overrides)))
    merged = schema
    for source, node in sources[1:]:
        try:
            merged = OmegaConf.merge(merged, node)
        except OmegaConfBaseException as error:
            raise ConfigError(_describe(error, source)) from error
    try:
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        raise ConfigError(_describe(error, "config")) from error
    return with_model_from_init(config)


def with_model_from_init(config: JobConfig) -> JobConfig:
    """When init.hf_path or init.checkpoint is set, the architecture comes from there (and the
    `model` section must not also be set, so two descriptions can never disagree)."""
    source = config.init.hf_path or config.init.checkpoint
    if not source:
        return config
    if config.model != ModelConfig():
        raise ConfigError(f"the model comes from {source}: remove the 'model' section "
                          "(and model.* overrides) from the config")
    try:
        if config.init.hf_path:
            from ..conversion.hf_to_mcore import model_config_of_hf
            model = model_config_of_hf(config.init.hf_path)
        else:
            from ..checkpoint.weights_io import read_metadata
            model = read_metadata(config.init.checkpoint)["model"]
    except (OSError, ValueError) as error:
        raise ConfigError(f"init: {error}") from error
    return dataclasses.replace(config, model=model)


def to_yaml(config: JobConfig) -> str:
    """The fully resolved config as YAML (saved with every run for reproducibility)."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))

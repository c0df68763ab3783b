"""YAML files plus dotted command-line overrides -> a typed, frozen JobConfig.

OmegaConf does the merging and the type checks against the dataclass schema, so an unknown key
or a wrong type fails with the full dotted key before anything starts. YAML files may list
others under `defaults:` (paths relative to the including file), merged first.
"""

from __future__ import annotations

import os
from typing import Iterable

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .job import ConfigError, JobConfig


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
    (values parsed as YAML: `optimizer.lr=1e-4`, `model.tie_embeddings=true`). The model of an
    init checkpoint is read by the job (`conversion.model_source.with_model_from_init`)."""
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
    return config


def to_yaml(config: JobConfig) -> str:
    """The fully resolved config as YAML (saved with every run for reproducibility)."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))

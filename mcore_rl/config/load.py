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
    for source, node in sources[1:]:
        _refuse_lora_fields_while_disabled(node, merged, source)
    try:
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        raise ConfigError(_describe(error, "config")) from error
    return config


def _refuse_lora_fields_while_disabled(node, merged, source: str) -> None:
    """A LoRA field set, with `enabled` neither set beside it nor true, would silently train every
    weight (verl users set only a rank): refuse it, naming `enabled`. A section that says
    `enabled: false` itself (a run's saved config.yaml) is taken as written."""
    for path in _lora_sections(node):
        fields = list(OmegaConf.select(node, path))
        if "enabled" not in fields and fields and not OmegaConf.select(merged, f"{path}.enabled"):
            raise ConfigError(
                f"{source}: {path}.{fields[0]} is set but {path}.enabled is false: adapters are "
                f"off and every weight would train; set {path}.enabled=true, or leave the "
                f"{path} fields out")


def _lora_sections(node, prefix: str = "") -> list[str]:
    """Dotted paths of every `lora` mapping in a user's config node."""
    found = []
    for name, value in node.items():
        path = f"{prefix}{name}"
        if OmegaConf.is_dict(value):
            found += [path] if name == "lora" else _lora_sections(value, f"{path}.")
    return found


def to_yaml(config: JobConfig) -> str:
    """The fully resolved config as YAML (saved with every run for reproducibility)."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))

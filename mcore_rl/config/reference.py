"""The configuration reference (docs/configuration.md), generated from the config dataclasses.

Every config field carries its documentation as the string literal right after its annotated
assignment. Python keeps no such attribute docstrings at runtime, so they are read back from the
source with `ast`; types come from the annotations and defaults from a default `JobConfig()`
(so factory defaults such as the critic's learning rate show what a job really gets). The
Markdown is a pure function of the code: tests compare the committed file with it, so the
reference cannot go stale, and fail when a field has no docstring.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import types
import typing
from typing import Iterator

from .job import JobConfig

DOC_PATH = "docs/configuration.md"
"""Where the reference lives, relative to the repository root."""

REGENERATE_COMMAND = ".venv/bin/python scripts/config_reference.py --write"
"""The command that rewrites DOC_PATH (named in its header and in the staleness test)."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One row of the reference: a config field under its dotted key."""

    key: str
    """Dotted key as written in YAML paths and overrides, e.g. rollout.sampling.n."""

    type: str
    """The annotation, readably (int, str | None, list[str], OptimizerConfig, ...)."""

    default: object
    """The default in a default JobConfig (for a nested section: its config object)."""

    doc: str
    """The field's docstring on one line ("" when it has none)."""

    section: bool
    """Whether the field is itself a config dataclass (its fields follow as their own rows)."""


# -- reading docstrings -------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _module_classes(path: str) -> dict[str, ast.ClassDef]:
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read(), path)
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def _one_line(text: str) -> str:
    return " ".join(inspect.cleandoc(text).split())


def _own_field_docs(cls: type) -> dict[str, str]:
    """{field: docstring} of the fields `cls` itself declares, read from its source."""
    body = _module_classes(inspect.getsourcefile(cls))[cls.__name__].body
    docs = {}
    for statement, following in zip(body, body[1:]):
        if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[statement.target.id] = _one_line(following.value.value)
    return docs


def field_docs(cls: type) -> dict[str, str]:
    """{field: docstring} of a dataclass, inherited fields included."""
    docs = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            docs.update(_own_field_docs(base))
    return docs


def class_doc(cls: type) -> str:
    """The class docstring on one line."""
    return _one_line(cls.__doc__ or "")


# -- walking the tree --------------------------------------------------------------------------
def _config_class(hint) -> type | None:
    """The config dataclass a hint names (X or X | None), else None."""
    candidates = typing.get_args(hint) if _is_union(hint) else (hint,)
    classes = [each for each in candidates if dataclasses.is_dataclass(each)]
    return classes[0] if len(classes) == 1 else None


def _is_union(hint) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def type_name(hint) -> str:
    """int, str | None, tuple[int, ...], dict[str, str], OptimizerConfig."""
    if hint is type(None):
        return "None"
    if hint is Ellipsis:
        return "..."
    if _is_union(hint):
        return " | ".join(type_name(each) for each in typing.get_args(hint))
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is not None and args:
        return f"{origin.__name__}[{', '.join(type_name(each) for each in args)}]"
    return getattr(hint, "__name__", str(hint))


def entries(config: object = None, prefix: str = "") -> Iterator[Entry]:
    """Every field under `config` (default: JobConfig()) depth-first in declaration order; a
    nested config's row comes before its fields' rows. A nested config that defaults to None is
    walked with its own class's defaults (what setting it starts from)."""
    config = JobConfig() if config is None else config
    cls = type(config)
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    for item in dataclasses.fields(cls):
        key, value = f"{prefix}{item.name}", getattr(config, item.name)
        nested = _config_class(hints[item.name])
        yield Entry(key, type_name(hints[item.name]), value, docs.get(item.name, ""),
                    nested is not None)
        if nested is not None:
            yield from entries(value if value is not None else nested(), key + ".")


def missing_docs() -> list[str]:
    """Dotted keys of the fields without a docstring."""
    return [entry.key for entry in entries() if not entry.doc]


# -- Markdown -----------------------------------------------------------------------------------
def format_default(value: object) -> str:
    """The default as JSON (also valid YAML), e.g. 1e-05, "vllm", null, true, []."""
    if dataclasses.is_dataclass(value):
        return ""
    return json.dumps(list(value) if isinstance(value, tuple) else value)


def _cell(text: str) -> str:
    """Table-safe text: pipes escaped; `<` outside code spans escaped so tags such as <answer>
    are shown instead of swallowed as HTML."""
    parts = text.split("`")
    parts[::2] = [part.replace("<", "&lt;") for part in parts[::2]]
    return "`".join(parts).replace("|", "\\|")


def _row(entry: Entry) -> str:
    default = format_default(entry.default)
    doc = entry.doc
    if entry.section and entry.default is None:
        doc += " When set, its fields default as below."
    cells = [f"`{entry.key}`", _cell(entry.type), _cell(f"`{default}`" if default else ""),
             _cell(doc)]
    return "| " + " | ".join(cells) + " |"


def _section(name: str, doc: str, config: object) -> list[str]:
    intro = " ".join(text for text in (doc, class_doc(type(config))) if text)
    return [f"## {name}", "", _cell(intro), "", "| key | type | default | description |",
            "|---|---|---|---|", *map(_row, entries(config, name + "."))]


def render() -> str:
    """The whole reference as Markdown."""
    job = JobConfig()
    docs = field_docs(JobConfig)
    names = [item.name for item in dataclasses.fields(JobConfig)]
    lines = [
        "# Configuration reference", "",
        f"_Generated from the field docstrings in `mcore_rl/config/*.py`; do not edit by hand. "
        f"Regenerate with `{REGENERATE_COMMAND}`._", "",
        _cell(class_doc(JobConfig)) + " Set fields in a YAML file (`--config FILE`, nested as "
        "the dotted keys below) or on the command line as `key=value` overrides (values parsed "
        "as YAML), e.g. `rollout.sampling.max_new_tokens=512`. Defaults are shown as JSON, "
        "which YAML also reads.", "",
        "Sections: " + ", ".join(f"[{name}](#{name})" for name in names) + ".", ""]
    for name in names:
        lines += _section(name, docs.get(name, ""), getattr(job, name)) + [""]
    return "\n".join(lines)


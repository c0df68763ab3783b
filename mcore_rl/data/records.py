"""One prompt of the dataset, and the rules a raw row must follow to become one.

Rows arrive in verl's layout (`prompt`, `data_source`, `reward_model.ground_truth`,
`extra_info`) from files users already have. Every rule is checked here, at load time, so a bad
row stops the job (or is skipped and counted) before any rollout, with a message that names the
rule; the file readers add the file name and row number.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

Messages = list[dict[str, str]]
Prompt = Union[str, Messages]


class DataError(ValueError):
    """A dataset or configuration that cannot be used; the message names the file and row."""


class BadRow(ValueError):
    """One row breaks a rule (the message names the rule, the reader adds where it is)."""


@dataclass(frozen=True)
class PromptRecord:
    """One prompt with what the reward needs to score its responses."""

    index: int
    """Position in the loaded dataset (train or val), a stable id for logs and the sampler."""

    prompt: Prompt
    """Plain text, or chat messages [{"role": ..., "content": ...}]."""

    data_source: str
    """Which dataset or task the prompt is from; the reward is chosen by it."""

    ground_truth: Any = None
    """reward_model.ground_truth (JSON-like), or None when the row has none."""

    extra_info: dict = field(default_factory=dict)
    """Free-form per-row information passed on to the reward (JSON-like)."""


def check_messages(messages: Any) -> Messages:
    """Chat messages as plain dicts; raises BadRow unless every message is a dict with a string
    role and a string content. Keys with None values (parquet fills absent struct fields with
    None) are dropped."""
    if not messages:
        raise BadRow("prompt is an empty list of messages")
    checked = []
    for position, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRow(f"prompt messages must be dicts with role and content; message "
                         f"{position} is a {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role or not isinstance(content, str):
            raise BadRow(f"prompt messages must be dicts with role and content (strings); "
                         f"message {position} is {_short(message)}")
        checked.append({key: value for key, value in message.items() if value is not None})
    return checked


def check_prompt(prompt: Any) -> Prompt:
    """A non-blank string, or valid chat messages (see check_messages); raises BadRow."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise BadRow("prompt is empty")
        return prompt
    if isinstance(prompt, (list, tuple)):
        return check_messages(prompt)
    raise BadRow(f"prompt must be text or a list of chat messages, not "
                 f"{type(prompt).__name__}")


def record_from_row(row: Any, prompt_key: str, index: int) -> PromptRecord:
    """The PromptRecord of one verl-style row; raises BadRow naming the broken rule."""
    if not isinstance(row, dict):
        raise BadRow(f"a row must be a JSON object, not {type(row).__name__}")
    if row.get(prompt_key) is None:
        raise BadRow(f"no {prompt_key!r} column (the row has {sorted(row)})")
    prompt = check_prompt(row[prompt_key])
    data_source = row.get("data_source")
    if not isinstance(data_source, str) or not data_source:
        raise BadRow(f"'data_source' must be a non-empty string, not {_short(data_source)} "
                     "(the reward is chosen by it)")
    return PromptRecord(index=index, prompt=prompt, data_source=data_source,
                        ground_truth=_ground_truth(row.get("reward_model")),
                        extra_info=_extra_info(row.get("extra_info")))


def _ground_truth(reward_model: Any) -> Any:
    if reward_model is None:
        return None
    if not isinstance(reward_model, dict):
        raise BadRow(f"'reward_model' must be a dict like {{\"ground_truth\": ..., "
                     f"\"style\": \"rule\"}}, not {_short(reward_model)}")
    return reward_model.get("ground_truth")


def _extra_info(extra_info: Any) -> dict:
    if extra_info is None:
        return {}
    if not isinstance(extra_info, dict):
        raise BadRow(f"'extra_info' must be a dict, not {_short(extra_info)}")
    return extra_info


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."

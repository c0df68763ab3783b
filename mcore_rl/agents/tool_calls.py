"""Tool calls read from the model's text, and checked before anything runs.

What the model writes is untrusted: a malformed call, an unknown tool or wrong arguments become
an error message the model reads next turn (and a count), never an exception in the job.
"hermes" (the <tool_call>{"name": ..., "arguments": {...}}</tool_call> format of Hermes and Qwen
models) is implemented here, reading well-formed calls as vLLM's hermes parser does (tested
against it), but reporting malformed ones instead of silently reading them as plain text; it
runs in the episodes' sandboxed processes, which cannot hold vLLM (a user's parser,
"module:function", runs there too).
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
from dataclasses import dataclass, field
from typing import Callable

HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for."""

    name: str
    arguments: dict = field(default_factory=dict)


class ToolCallError(ValueError):
    """The model's text holds a tool call that cannot be read (its message is shown to the
    model)."""


def parse_hermes(text: str) -> list[ToolCall]:
    """The <tool_call> blocks of `text` (an unclosed last block included); [] when none."""
    calls = []
    for body in HERMES_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as error:
            raise ToolCallError(f"the tool call is not valid JSON ({error.msg} at character "
                                f"{error.pos}): {body.strip()[:200]}") from None
        calls.append(_tool_call(call))
    return calls


def _tool_call(call) -> ToolCall:
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ToolCallError('a tool call must be a JSON object with a "name" string')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise ToolCallError(f'the "arguments" of {call["name"]} are not a JSON object') \
                from None
    if not isinstance(arguments, dict):
        raise ToolCallError(f'the "arguments" of {call["name"]} must be a JSON object')
    return ToolCall(call["name"], arguments)


def load_parser(spec: str) -> Callable[[str], list[ToolCall]]:
    """The parser `rollout.multi_turn.tool_parser` names."""
    if spec == "hermes":
        return parse_hermes
    return resolve(spec, "rollout.multi_turn.tool_parser")


def resolve(reference: str, field_name: str):
    """The object a "module:attribute" reference names, or an error naming the field."""
    module_name, _, attribute = reference.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"{field_name}={reference!r} cannot be loaded: {error}") from None


def bind_arguments(function: Callable, call: ToolCall) -> inspect.BoundArguments:
    """The call's arguments bound to the tool's parameters; ToolCallError when they do not
    fit (missing, unexpected)."""
    try:
        return inspect.signature(function).bind(**call.arguments)
    except TypeError as error:
        raise ToolCallError(f"{call.name}: {error}") from None

"""The environment a user writes: a class whose documented public methods are the model's tools.

    class HiddenMax(Environment):
        def reset(self, row):
            self.table = row["extra_info"]["table"]      # the prompt comes from the row

        def lookup(self, key: str) -> str:
            \"\"\"The digit stored under a key.

            Args:
                key: a letter from a to j.
            \"\"\"
            return str(self.table[key])

One instance lives for one episode, inside that episode's sandboxed process (the user's code and
the model's arguments never run in the trainer's process). `step` is called with each model
turn; its default reads the turn's tool calls, runs them and answers with one tool message per
call, and ends the episode on a turn without calls (the final answer). Override it for
environments that are not tool calls (a game, a simulated user). The shape follows TRL's
`environment_factory`, which users already write.
"""

from __future__ import annotations

import inspect
import time
import types
from typing import Callable

from .tool_calls import ToolCall, ToolCallError, bind_arguments

Observation = "str | list[dict] | None"
"""What reset and step return: a user message's text, messages, or None (reset: the dataset's
prompt as it is; step: the episode ends)."""

HOOKS = ("reset", "step", "get_reward")


class Environment:
    """Base class of multi-turn environments (see the module's docstring)."""

    def reset(self, row: dict):
        """Start an episode for a dataset row (`prompt`, `data_source`, `ground_truth`,
        `extra_info`). Return the opening messages (a user message's text, or a list of
        messages) or None to use the row's prompt."""
        return None

    def step(self, assistant_message: str):
        """The model's turn (its raw text) -> what the model reads next: a user message's text,
        a list of messages (e.g. role "tool"), or None to end the episode. Default: run the
        tool calls in the text, one tool message per call; no call ends the episode."""
        try:
            calls = self.parse_tool_calls(assistant_message)
        except ToolCallError as error:
            self.counts["parse_failures"] += 1
            return [{"role": "tool", "content": f"error: {error}"}]
        if not calls:
            return None
        return [{"role": "tool", "name": call.name, "content": self.call_tool(call)}
                for call in calls]

    def get_reward(self, messages: list[dict]) -> float | None:
        """The episode's reward from its whole conversation; None (the default) scores the
        final assistant message with the reward function of the row's data_source."""
        return None

    # -- machinery the episode's process sets up; not meant to be overridden ------------------
    parse_tool_calls: Callable[[str], list[ToolCall]] = staticmethod(lambda text: [])
    """The configured tool-call parser (rollout.multi_turn.tool_parser)."""

    extra_tools: dict[str, Callable] = {}
    """Plain-function tools from rollout.multi_turn.tools."""

    @property
    def counts(self) -> dict:
        """This episode's tool statistics so far (read by the runner after each call)."""
        if "_counts" not in self.__dict__:
            self._counts = {"tool_calls": 0, "tool_errors": 0, "parse_failures": 0,
                            "tool_seconds": 0.0}
        return self._counts

    def tools(self) -> dict[str, Callable]:
        """Name -> callable of every tool the model may call."""
        return {**environment_methods(self), **self.extra_tools}

    def call_tool(self, call: ToolCall) -> str:
        """Run one call; its result as text, or an error text the model reads (unknown tool,
        arguments that do not fit, an exception in the tool)."""
        self.counts["tool_calls"] += 1
        tools = self.tools()
        started = time.perf_counter()
        try:
            if call.name not in tools:
                raise ToolCallError(f"unknown tool {call.name!r}; the tools are "
                                    f"{', '.join(sorted(tools))}")
            bound = bind_arguments(tools[call.name], call)
            return str(tools[call.name](*bound.args, **bound.kwargs))
        except Exception as error:  # the model's call failed: it reads why
            self.counts["tool_errors"] += 1
            return f"error: {type(error).__name__}: {error}" \
                if not isinstance(error, ToolCallError) else f"error: {error}"
        finally:
            self.counts["tool_seconds"] += time.perf_counter() - started


def environment_methods(environment) -> dict[str, Callable]:
    """The public methods a subclass adds (its tools), bound to the instance or class given."""
    return {name: getattr(environment, name)
            for name, member in inspect.getmembers(type(environment) if isinstance(
                environment, Environment) else environment, inspect.isfunction)
            if not name.startswith("_") and name not in HOOKS and not hasattr(Environment, name)}


def tool_schemas(environment_class: type, functions: dict[str, Callable]) -> list[dict]:
    """OpenAI-style function schemas of the environment's methods and the plain tools, for
    the chat template; ValueError naming the tool whose docstring or hints cannot be read."""
    from transformers.utils import get_json_schema  # here: transformers takes a second to load

    # Bound to a placeholder, a method's signature loses `self`, as the model's calls do.
    methods = {name: types.MethodType(method, object())
               for name, method in environment_methods(environment_class).items()}
    schemas = []
    for name, function in {**methods, **functions}.items():
        try:
            schema = get_json_schema(function)
        except Exception as error:
            raise ValueError(f"tool {name!r} ({function.__qualname__}) needs type hints and a "
                             f"Google-style docstring describing every argument: {error}") \
                from None
        schemas.append(schema)  # {"type": "function", "function": {...}}
    return schemas

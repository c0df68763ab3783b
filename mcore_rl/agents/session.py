"""What runs inside an episode's sandboxed process: the environment instance and its tools.

The runner talks to it with three requests, each bounded by the sandbox's limits:
("reset", row) -> opening; ("step", assistant text) -> (observation, tool counts);
("reward", messages) -> float or None.
"""

from __future__ import annotations

from dataclasses import dataclass

from .environment import Environment
from .python_tool import run_python
from .tool_calls import load_parser, resolve

PYTHON_TOOL = "python"


@dataclass(frozen=True)
class EpisodeSpec:
    """Everything an episode's process needs to build its environment (picklable)."""

    environment: str
    """"module:Class" of the Environment subclass; empty: the base class (tools only)."""

    tools: tuple[str, ...]
    """"module:function" tools, or "python"."""

    tool_parser: str
    """rollout.multi_turn.tool_parser."""

    python_timeout_seconds: float
    """Limits of one run of the python tool."""

    python_memory_mb: int

    def modules(self) -> tuple[str, ...]:
        """The modules an episode's process imports (the sandbox preloads them)."""
        references = (self.environment, *self.tools, self.tool_parser)
        return (__name__, *dict.fromkeys(reference.partition(":")[0]
                                         for reference in references if ":" in reference))

    def main_objects(self) -> tuple:
        """What it names from the main module (the user's script): sent by value."""
        references = (self.environment, *self.tools, self.tool_parser)
        return tuple(resolve(reference, "rollout.multi_turn") for reference in references
                     if reference.startswith("__main__:"))


def environment_class(reference: str) -> type:
    """The Environment subclass `reference` names (the base class for none)."""
    if not reference:
        return Environment
    cls = resolve(reference, "rollout.multi_turn.environment")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"rollout.multi_turn.environment={reference!r} is not a subclass of "
                         "mcore_rl.agents.Environment")
    return cls


def function_tools(references: tuple[str, ...], spec: EpisodeSpec | None = None) -> dict:
    """Name -> function of the configured plain tools."""
    tools = {}
    for reference in references:
        function = python_tool(spec) if reference == PYTHON_TOOL else \
            resolve(reference, "rollout.multi_turn.tools")
        tools[function.__name__] = function
    return tools


def python_tool(spec: EpisodeSpec | None):
    """The built-in interpreter as a tool, with the spec's limits."""
    timeout = spec.python_timeout_seconds if spec else 10.0
    memory = spec.python_memory_mb if spec else 512

    def python(code: str) -> str:
        """Run a Python program and return what it prints (and the error, if it fails).

        Args:
            code: The program; print the values you need.
        """
        return run_python(code, timeout_seconds=timeout, memory_mb=memory)

    return python


class EpisodeSession:
    """The sandbox handler of one episode."""

    def __init__(self, spec: EpisodeSpec):
        self.environment = environment_class(spec.environment)()
        self.environment.parse_tool_calls = load_parser(spec.tool_parser)
        self.environment.extra_tools = function_tools(spec.tools, spec)

    def __call__(self, request: tuple):
        kind, payload = request
        if kind == "reset":
            return self.environment.reset(payload)
        if kind == "step":
            observation = self.environment.step(payload)
            return observation, dict(self.environment.counts)
        if kind == "reward":
            return self.environment.get_reward(payload)
        raise ValueError(f"unknown episode request {kind!r}")

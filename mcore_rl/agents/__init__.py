"""Multi-turn episodes: environments and tools the model uses over several turns, run in
sandboxed processes, with token-exact trajectories (see docs/agents.md).

    from mcore_rl.agents import Environment

The names are resolved on first use: the sandbox's processes (mcore_rl.sandbox) import the
episode session, and each module imported there (torch above all) would count against
every session's memory limit.
"""

import importlib

_HOMES = {"AgentRunner": "agent_runner", "ChatEndpoint": "openai_endpoint",
          "ChatFormat": "chat", "TemplateMismatch": "chat", "Environment": "environment",
          "tool_schemas": "environment", "EpisodeRunner": "runner", "EpisodeSpec": "session",
          "environment_class": "session", "function_tools": "session", "ToolCall": "tool_calls",
          "ToolCallError": "tool_calls"}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    raise AttributeError(f"module 'mcore_rl.agents' has no attribute {name!r}")

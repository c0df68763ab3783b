"""Multi-turn rollouts: the model talks with an environment (tools, a game, a simulated user)
over several turns before the episode is scored.

An episode is trained on the tokens the engine sampled, never on text decoded and encoded again;
observations are tokenised as the chat template renders them (mcore_rl/agents/chat.py). Whatever
the model writes reaches the environment and its tools only inside sandboxed processes, with the
limits below. An agent written against the OpenAI API (`agent`) is the user's own code and runs
in the rank's process: what it does with the model's text is its own business.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TEMPLATE_MISMATCHES = ("error", "end")


@dataclass(frozen=True)
class ToolSandboxConfig:
    """Limits of the processes that run environments and tools (one per episode)."""

    timeout_seconds: float = 30.0
    """Wall-clock limit of one environment call (reset, a step with its tools, the reward):
    past it the episode's process is killed, the model sees an error and the episode ends."""

    memory_mb: int = 1024
    """Address-space limit of an episode's process (RLIMIT_AS)."""

    cpu_seconds: float = 30.0
    """CPU seconds one environment call may use."""

    max_processes: int = 16
    """Processes an episode's tools may start (RLIMIT_NPROC)."""

    network: bool = False
    """Whether tools may use the network (false: a private network namespace, or Landlock's
    TCP rules where namespaces are unavailable)."""

    environment: tuple[str, ...] = ()
    """Names of the rank's environment variables that environments and tools see (an API key
    a simulated user needs); besides PATH, LANG, LC_ALL, TZ, OMP_NUM_THREADS and
    LD_LIBRARY_PATH they see none (the rank's holds W&B, HF and cloud credentials)."""

    readable: tuple[str, ...] = ()
    """Folders and files environments and tools may read besides the system's folders, the
    Python installation and the user's code folders (the import path's, with the data beside
    a module) (a dataset an environment opens elsewhere);
    nothing else (home, checkpoints, other episodes' folders) is readable. Code the model
    writes (the python tool) reads none of these nor the user's code: its interpreter has a
    Landlock domain of its own (the Python installation, system libraries, the episode's
    folder)."""

    allow_unconfined: bool = False
    """Whether to run where Landlock does not work (an old kernel, a container filtering its
    calls), with reads and writes limited only by file permissions (the network and process
    limits still hold), logged once at start; false: the job refuses to start there, since
    nothing else keeps environments and model-written code from the machine's files."""

    def errors(self) -> list[str]:
        """Broken rules, each naming its field (empty when valid)."""
        prefix = "rollout.multi_turn.sandbox."
        errors = [f"{prefix}{name}={getattr(self, name)} must be positive"
                  for name in ("timeout_seconds", "memory_mb", "cpu_seconds", "max_processes")
                  if getattr(self, name) <= 0]
        return errors


@dataclass(frozen=True)
class MultiTurnConfig:
    """Episodes of several turns instead of one response per prompt (off unless
    `environment`, `tools` or `agent` is set)."""

    environment: str = ""
    """"module:Class", a subclass of mcore_rl.agents.Environment: one instance per episode,
    made in the episode's sandboxed process. Empty with `tools` set: the tools alone."""

    tools: list[str] = field(default_factory=list)
    """"module:function" tools offered to the model (documented functions: their type hints
    and docstrings become the JSON schema), plus "python" for the built-in interpreter.
    Added to the environment's own tools."""

    agent: str = ""
    """"module:async_function", an agent written against the OpenAI API instead of an
    environment: `async def run(row, base_url) -> reward` drives each episode through a
    chat endpoint on the rank's engine (base_url is an OpenAI base URL; row holds prompt,
    data_source, ground_truth, extra_info; a None reward: the data source's reward function
    scores the final answer). It runs in the rank's process with its own tools; the trained
    tokens are still the sampled ones. Excludes `environment` and `tools`."""

    agent_timeout_seconds: float = 600.0
    """Wall-clock limit of one run of `agent`: past it the run is cancelled, its reward is 0
    and it counts as an agent failure (a hung agent would stop every rank's rollout)."""

    tool_parser: str = "hermes"
    """How tool calls are read from the model's text: "hermes" (<tool_call>{"name": ...,
    "arguments": {...}}</tool_call>, Qwen's and Hermes' format, read as vLLM's hermes parser
    reads it) or "module:function" (text -> list of mcore_rl.agents.ToolCall, raising
    mcore_rl.agents.ToolCallError on malformed calls)."""

    max_turns: int = 4
    """Model turns per episode; an episode still calling tools after its last turn is
    truncated (an agent's requests past it are answered with no tokens, finish_reason
    "length")."""

    max_episode_tokens: int = 1024
    """Prompt + every turn + every observation, in tokens; an episode that would exceed it ends
    (truncated, handled as rollout.overlong says)."""

    max_observation_tokens: int = 256
    """Longest observation message content, in tokens; longer contents are cut (counted).
    Not applied to an agent's messages (they are the agent's own)."""

    python_timeout_seconds: float = 10.0
    """Wall-clock limit of one run of the built-in python tool (shorter than
    sandbox.timeout_seconds, so that a hung program is an error the model reads)."""

    template_kwargs: dict = field(default_factory=dict)
    """Extra arguments of the chat template (e.g. {enable_thinking: false} for Qwen3)."""

    template_mismatch: str = "error"
    """A chat template that does not render the conversation so far as a prefix of the
    conversation with the next observation (e.g. one that drops earlier reasoning): "error"
    refuses it at start-up, from a probe conversation; "end" runs it anyway. Either way a
    turn the template renders otherwise at run time (from what the model wrote) ends its
    episode there, counted in episode/template_mismatches: model output never stops the
    job."""

    sandbox: ToolSandboxConfig = field(default_factory=ToolSandboxConfig)
    """Limits of the environments' and tools' processes."""

    @property
    def enabled(self) -> bool:
        """Whether rollouts are multi-turn episodes."""
        return bool(self.environment or self.tools or self.agent)

    def errors(self) -> list[str]:
        """Broken rules, each naming its field (empty when valid)."""
        prefix = "rollout.multi_turn."
        errors = []
        if self.tool_parser != "hermes" and ":" not in self.tool_parser:
            errors.append(f"{prefix}tool_parser={self.tool_parser!r} must be 'hermes' or "
                          "'module:function'")
        if self.environment and ":" not in self.environment:
            errors.append(f"{prefix}environment={self.environment!r} must be 'module:Class'")
        if self.agent and ":" not in self.agent:
            errors.append(f"{prefix}agent={self.agent!r} must be 'module:async_function'")
        if self.agent_timeout_seconds <= 0:
            errors.append(f"{prefix}agent_timeout_seconds={self.agent_timeout_seconds} must be "
                          "positive")
        if self.agent and (self.environment or self.tools):
            errors.append(f"{prefix}agent={self.agent!r} and {prefix}environment="
                          f"{self.environment!r} / tools={self.tools} exclude each other: an "
                          "agent runs its own tools, set either")
        errors += [f"{prefix}tools entry {tool!r} must be 'module:function' or 'python'"
                   for tool in self.tools if tool != "python" and ":" not in tool]
        if self.max_turns < 1:
            errors.append(f"{prefix}max_turns={self.max_turns} must be >= 1")
        if self.max_observation_tokens < 1:
            errors.append(f"{prefix}max_observation_tokens={self.max_observation_tokens} must "
                          "be >= 1")
        if self.template_mismatch not in TEMPLATE_MISMATCHES:
            errors.append(f"{prefix}template_mismatch={self.template_mismatch!r} must be one "
                          f"of {TEMPLATE_MISMATCHES}")
        if "python" in self.tools and not \
                0 < self.python_timeout_seconds < self.sandbox.timeout_seconds:
            errors.append(f"{prefix}python_timeout_seconds={self.python_timeout_seconds} must "
                          f"be in (0, sandbox.timeout_seconds={self.sandbox.timeout_seconds})")
        return errors + self.sandbox.errors()

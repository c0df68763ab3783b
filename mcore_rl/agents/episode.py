"""One conversation while it runs: its tokens (sampled or observed), its messages, its counts.

The token list only ever grows: the prompt, then each model turn as the engine sampled it
(mask 1, with its log-probs), then each observation as the chat template renders it (mask 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

COUNTS = ("tool_calls", "tool_errors", "parse_failures", "tool_seconds")
"""The tool statistics an episode's environment reports after each step."""


@dataclass
class Episode:
    """A running episode of prompt `prompt_index`, sample `sample_index`."""

    key: str
    prompt_index: int
    sample_index: int
    row: dict
    """The dataset row the environment's reset receives."""

    messages: list[dict] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)
    """1 on each token of token_ids the engine sampled."""
    logprobs: list[float] = field(default_factory=list)
    prompt_length: int = 0
    """Tokens fed before the first turn."""
    last_turn: list[int] = field(default_factory=list)
    """The latest model turn's tokens."""
    turns: int = 0
    finish_reason: str = "stop"
    """"stop" (the environment ended it) or "length" (a limit cut it short)."""
    reward: float | None = None
    """The environment's reward (None: the reward function of the row's data_source)."""
    counts: dict = field(default_factory=lambda: {name: 0 for name in COUNTS})
    flags: dict = field(default_factory=lambda: {
        "tool_timeouts": 0, "observations_truncated": 0, "template_mismatches": 0,
        "environment_failures": 0, "history_rewrites": 0, "agent_failures": 0})
    """Counts of what went wrong; history_rewrites and agent_failures: agents written against
    the OpenAI API (agents.agent_runner)."""
    prompt_tokens: int = 0
    """Prompt tokens of the engine requests made for the episode (each turn's: the
    conversation so far), and"""
    cached_tokens: int = 0
    """how many of them the engine's prefix cache served."""
    versions: list[tuple[int, int]] = field(default_factory=list)
    """(first token in token_ids, policy version) of each stretch of model turns sampled with
    one version of the weights (split placement, where an update lands while the episode
    runs); empty where the engine reports no versions."""
    routes: Optional[torch.Tensor] = None
    """Mixture-of-Experts routes the engine took for the tokens fed so far [fed, MoE layers,
    k] (rollout.routing_replay=r3), each from the first request that fed its token: a model
    turn's from the request that sampled it, an observation's (and a turn's last token's)
    from the next turn's request, which prefilled them."""

    def start(self, messages: list[dict], prompt_ids: list[int]) -> None:
        self.messages = list(messages)
        self.token_ids = list(prompt_ids)
        self.sampled = [0] * len(prompt_ids)
        self.logprobs = [0.0] * len(prompt_ids)
        self.prompt_length = len(prompt_ids)

    def add_turn(self, token_ids: list[int], logprobs: list[float],
                 versions: tuple[tuple[int, int], ...] = ()) -> None:
        """A model turn, with the versions that sampled its stretches (FinishedSample's)."""
        for first, version in versions:
            if not self.versions or self.versions[-1][1] != version:
                self.versions.append((len(self.token_ids) + first, version))
        self.token_ids += token_ids
        self.sampled += [1] * len(token_ids)
        self.logprobs += logprobs
        self.last_turn = list(token_ids)
        self.turns += 1

    def count_prefill(self, request) -> None:
        """Add the prompt tokens and cache hits of a finished engine request (FinishedSample),
        or of an agent's requests (AgentEpisode)."""
        self.prompt_tokens += request.prompt_tokens
        self.cached_tokens += request.cached_tokens

    def add_routes(self, routes: Optional[torch.Tensor]) -> None:
        """Keep the routes of a finished turn's request (its prompt, the conversation so far,
        and the turn but its last token) for the tokens no earlier request fed."""
        if routes is None:
            return
        known = 0 if self.routes is None else len(self.routes)
        if known == 0:
            self.routes = routes
        elif len(routes) > known:
            self.routes = torch.cat([self.routes, routes[known:]])

    def add_observation(self, messages: list[dict], token_ids: list[int]) -> None:
        self.messages += messages
        self.token_ids += token_ids
        self.sampled += [0] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)

    def response_versions(self, response_start: int) -> tuple[tuple[int, int], ...]:
        """`versions` for the tokens from `response_start` on (Completion.versions: the first
        stretch starts the response)."""
        return tuple((max(first - response_start, 0) if index else 0, version)
                     for index, (first, version) in enumerate(self.versions))

    def final_text(self) -> str:
        """The last assistant message (what a reward function scores)."""
        return next((m["content"] for m in reversed(self.messages)
                     if m["role"] == "assistant"), "")

    def summary(self) -> dict:
        """The counts logged per episode (agents.metrics) and the conversation."""
        sampled = sum(self.sampled)
        return {"turns": self.turns, **self.counts, **self.flags,
                "model_tokens": sampled,
                "observation_tokens": len(self.token_ids) - self.prompt_length - sampled,
                "truncated": int(self.finish_reason == "length"),
                "messages": self.messages}

"""The rollout engine interface every backend implements, and its result types.

Every rank of the SPMD world calls the same methods in the same order. `generate` takes this
rank's own prompts (its data-parallel shard) and returns this rank's completions; how a backend
pools the prompts of the ranks that share one engine instance (a rollout TP group, or a Megatron
model-parallel group) is its own business (see `prompt_pool`).

Between generate phases the engine sleeps, so that training has the GPU. One generate phase,
in the order the GPU needs (weights can only be written into mapped memory, and the KV cache
comes back only once training has parked its state):

    engine.wake_weights(); engine.update_weights(...); <park training state>; engine.wake()
    engine.generate(...); engine.sleep(); <restore training state>
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import torch

from mcore_rl.config.rollout import PromptConfig, SamplingConfig
from mcore_rl.models.moe_routing import NO_ROUTE

class EngineError(RuntimeError):
    """An engine that could not start or run; raised on every rank of the engine's group."""


@dataclass(frozen=True)
class Completion:
    """One sampled response."""

    prompt_index: int
    """Index of its prompt in the caller's list."""

    sample_index: int
    """Which of the prompt's `sampling.n` samples this is."""

    token_ids: list[int]
    """Response tokens (the prompt excluded; a final stop token included). A multi-turn
    episode's: every token after the prompt, the model's turns and the observations between
    them."""

    logprobs: list[float]
    """Log-prob of each response token under the model's whole tempered distribution, before
    top-k/top-p truncation (what the trainer scores; greedy: the model's own distribution),
    where the engine can report it: the Megatron engine always, vLLM at temperature 1 (its raw
    log-probs) or without truncation; a vLLM engine started for processed log-probs reports
    them renormalised over the kept tokens, one started for raw ones NaN at other
    temperatures (`VllmEngine`). 0 on observation tokens."""

    finish_reason: str
    """"stop" (a stop token or string ended it) or "length" (max_new_tokens reached)."""

    versions: tuple[tuple[int, int], ...] = ()
    """Split placement: (first token, policy version) of each stretch of tokens sampled with
    one version of the weights, the first being the version that started the response (a
    partial rollout continued across weight updates has several). Empty: every token was
    sampled with the weights of the batch's version."""

    routed_experts: Optional[torch.Tensor] = None
    """Mixture-of-Experts models, where the engine reports them: the experts each token the
    engine computed (the prompt and every response token but the last) went to in each MoE
    layer, [prompt + response - 1, MoE layers, top-k] (models.moe_routing)."""

    sampled: Optional[tuple[int, ...]] = None
    """Multi-turn episodes: 1 where the engine sampled token_ids[i], 0 on observation tokens
    (tool results, environment messages, the chat template's text around them). None: every
    token was sampled (a single-turn response)."""

    response_text: Optional[str] = None
    """Multi-turn episodes: the final assistant message, which rule rewards score (the token
    ids hold observations too)."""

    episode: Optional[dict] = None
    """Multi-turn episodes: the conversation's messages and counts (agents.episode)."""

    prompt_tokens: int = 0
    """Prompt tokens the engine was given for this completion, over every request that made it
    (an episode: each turn's prompt, the conversation so far)."""

    cached_tokens: int = 0
    """Of `prompt_tokens`, those whose keys and values the engine's prefix cache served
    instead of computing them again (vLLM with rollout.prefix_caching; the Megatron engine
    has no prefix cache)."""

    def sampled_mask(self) -> list[int]:
        """1 on each token the engine sampled, 0 on observation tokens."""
        return list(self.sampled) if self.sampled is not None else [1] * len(self.token_ids)


@dataclass
class Generation:
    """What one `generate` call returns on one rank."""

    completions: list[Completion]
    """`n` completions per prompt, grouped by prompt in the caller's order."""

    prompts: list[list[int]]
    """The prompts as the engine saw them (after truncation, if configured)."""

    metrics: dict = field(default_factory=dict)
    """Counts for logging: prompts, truncated_prompts, generated_tokens, seconds, and the
    `prefill_counts` of the completions."""

    @classmethod
    def finished(cls, completions: list[Completion], prompts: list[list[int]], truncated: int,
                 started: float) -> "Generation":
        """This rank's result, with the metrics every engine reports (`started`: the
        perf_counter value when generate began)."""
        metrics = {"prompts": len(prompts), "truncated_prompts": truncated,
                   "generated_tokens": sum(len(c.token_ids) for c in completions),
                   "seconds": time.perf_counter() - started, **prefill_counts(completions)}
        return cls(completions, prompts, metrics)

    def response_tensors(self, pad_id: int = 0) -> dict[str, torch.Tensor]:
        """Right-padded prompt+response rows for the trainer: input_ids and attention_mask
        [n_completions, longest], response_mask (1 on the tokens the engine sampled: the
        response, or a multi-turn episode's model turns) and engine_logprobs aligned to the
        token they score (0 elsewhere)."""
        rows = [self.prompts[c.prompt_index] + c.token_ids for c in self.completions]
        longest = max(len(row) for row in rows)
        shape = (len(rows), longest)
        input_ids = torch.full(shape, pad_id, dtype=torch.long)
        attention_mask = torch.zeros(shape, dtype=torch.long)
        response_mask = torch.zeros(shape, dtype=torch.long)
        engine_logprobs = torch.zeros(shape, dtype=torch.float32)
        for row, (tokens, completion) in enumerate(zip(rows, self.completions)):
            start = len(tokens) - len(completion.token_ids)
            input_ids[row, :len(tokens)] = torch.tensor(tokens)
            attention_mask[row, :len(tokens)] = 1
            response_mask[row, start:len(tokens)] = torch.tensor(completion.sampled_mask())
            engine_logprobs[row, start:len(tokens)] = torch.tensor(completion.logprobs)
        tensors = {"input_ids": input_ids, "attention_mask": attention_mask,
                   "response_mask": response_mask, "engine_logprobs": engine_logprobs}
        routes = [c.routed_experts for c in self.completions]
        if any(route is not None for route in routes):
            tensors["routed_experts"] = _routes_by_row(routes, longest)
        return tensors


    def token_versions(self, default: int) -> torch.Tensor:
        """The policy version that sampled each token of the `response_tensors` rows [n,
        longest] (from Completion.versions; `default` where a completion records none; the
        prompt's and observations' entries are the version of the stretch they fall in)."""
        longest = max(len(self.prompts[c.prompt_index]) + len(c.token_ids)
                      for c in self.completions)
        versions = torch.full((len(self.completions), longest), default, dtype=torch.long)
        for row, completion in enumerate(self.completions):
            start = len(self.prompts[completion.prompt_index])
            for first, version in completion.versions:
                versions[row, start + first:] = version
        return versions


def prefill_counts(completions: Sequence[Completion]) -> dict[str, int]:
    """The prompt tokens the engine was given for these completions, and how many of them its
    prefix cache served (Generation.metrics: prompt_tokens, cached_prompt_tokens)."""
    return {"prompt_tokens": sum(c.prompt_tokens for c in completions),
            "cached_prompt_tokens": sum(c.cached_tokens for c in completions)}


def _routes_by_row(routes: list[torch.Tensor | None], longest: int) -> torch.Tensor:
    """Per-completion engine routes as the batch field ``routed_experts`` [n, longest, MoE
    layers, k], -1 where the engine computed no route (the last token, padding, every token of
    a completion without routes: its row is not replayed)."""
    shape = next(route.shape[1:] for route in routes if route is not None)
    result = torch.full((len(routes), longest, *shape), NO_ROUTE, dtype=torch.int16)
    for row, route in enumerate(routes):
        if route is not None:
            result[row, :len(route)] = route
    return result


@dataclass(frozen=True)
class SampleRequest:
    """One response to generate through an engine's streaming interface (split placement): the
    caller adds requests, steps the engine and collects responses as each one finishes, and
    can load new weights or abort requests between steps."""

    key: str
    """Unique among the requests in flight."""

    prompt: list[int]
    """Prompt token ids."""

    sampling: SamplingConfig
    """Sampling of this response (`n` is ignored: one response; `seed` must be set)."""

    prompt_position: int
    """The prompt's index in this engine instance's share of its batch, and"""

    sample_index: int
    """which of the prompt's samples this is: with `sampling.seed` and the engine instance
    they fix the response's random numbers (as `generate` fixes those of sample `sample_index`
    at position `prompt_position` of the data shard whose key is the instance's index: the
    same request samples the same either way in split placement)."""


@dataclass(frozen=True)
class FinishedSample:
    """A streamed response that has finished."""

    key: str
    token_ids: list[int]
    logprobs: list[float]
    """As in Completion: the log-prob each token was sampled with (whatever weights the engine
    held when it sampled that token)."""
    finish_reason: str
    routed_experts: Optional[torch.Tensor] = None
    """As in Completion: the experts each fed token went to, when the engine captures routes."""
    prompt_tokens: int = 0
    """The request's prompt tokens, and"""
    cached_tokens: int = 0
    """how many of them the engine's prefix cache served (as in Completion)."""
    versions: tuple[tuple[int, int], ...] = ()
    """As in Completion: (first token, policy version) stretches, where weights changed while
    the request ran (split placement's multi-turn episodes); empty elsewhere."""


class RolloutEngine(abc.ABC):
    """A text-generation engine hosted by the ranks of the training world."""

    weight_layout: str | None = None
    """The resharding rollout layout `update_weights` takes ("full": HF-named full tensors,
    "megatron": Megatron shards at the engine's TP), or None when the engine generates on the
    training model's own parameters and needs no update."""

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig,
                 prompt_config: PromptConfig = PromptConfig(),
                 first_position: int = 0) -> Generation:
        """Sample `sampling.n` responses for each of this rank's prompts (lists of token ids).
        first_position: the position of prompts[0] in this rank's data shard, when the prompts
        are one part of it (rl/shard_parts.py): random draws follow the position, so a part
        samples what generating the whole shard would. Bad prompts or sampling parameters
        raise before any generation starts."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights in place (names and layout per `weight_layout`), e.g. straight from
        `Resharder.sync`, without restarting the engine."""

    weights_survive_sleep: bool = True
    """Whether the weights loaded before `sleep` are still there after waking (False when
    sleeping discards them: they must be loaded again before the next generate)."""

    @abc.abstractmethod
    def sleep(self) -> None:
        """Free the KV cache (and weights, where the engine can) before training."""

    def wake_weights(self) -> None:
        """Map the weights' memory again, ready for `update_weights` (default: nothing)."""

    @abc.abstractmethod
    def wake(self) -> None:
        """Make the engine ready to generate again (the KV cache, and the weights if
        `wake_weights` was not called)."""

    supports_streaming: bool = False
    """Whether the streaming interface below (add_requests, step, abort) is implemented."""

    instance_group = None
    """The process group of the ranks that hold one engine instance together (vLLM's rollout
    TP, the Megatron engine's model-parallel group), which must bring the same requests; None
    when a rank holds its own."""

    shard_key: int = 0
    """This rank's data shard: ranks of an instance with equal keys bring equal prompts."""

    def add_requests(self, requests: Sequence[SampleRequest]) -> None:
        """Queue responses to generate (every rank of an engine instance adds the same ones)."""
        raise NotImplementedError(f"{type(self).__name__} has no streaming interface")

    def has_unfinished(self, local_work: bool = False) -> bool:
        """Whether any request is in flight on any engine instance, or any rank said it has
        `local_work` (requests it will add after more steps): collective over all of them,
        every rank must call it at the same point, and step() exactly when it is true."""
        raise NotImplementedError(f"{type(self).__name__} has no streaming interface")

    def step(self) -> list[FinishedSample]:
        """One engine iteration (about one token for every running request; collective like
        has_unfinished); the responses that finished in it."""
        raise NotImplementedError(f"{type(self).__name__} has no streaming interface")

    def generated_lengths(self) -> dict[str, int]:
        """Tokens generated so far by every request in flight, by key."""
        raise NotImplementedError(f"{type(self).__name__} has no streaming interface")

    def abort(self, keys: Iterable[str]) -> None:
        """Drop these requests (their tokens so far are discarded)."""
        raise NotImplementedError(f"{type(self).__name__} has no streaming interface")

    def close(self) -> None:
        """Release the engine before the process group goes (collective; default: nothing)."""

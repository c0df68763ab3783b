"""Check requests and pool them over the ranks that share one engine instance.

An engine instance spans a group of ranks (a vLLM rollout-TP group, or the Megatron
model-parallel group) and every rank of it must feed the same batch. Ranks arrive with their own
data-parallel shards: ranks with the same shard key (TP peers of one training DP rank) must bring
identical requests; requests of different keys are concatenated in rank order, each keeping its
own sampling parameters. Each rank then takes back its own slice of the results.

Validation happens here too, so that one rank's bad request makes every rank of the group raise
the same PromptError instead of leaving its peers waiting in the pooling collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch.distributed as dist

from mcore_rl.config.rollout import PromptConfig, SamplingConfig
from mcore_rl.runtime.regroup import gather_shares, one_share_per_key

from .prompts import PromptError, check_request, prepare_prompts


@dataclass(frozen=True)
class PooledRequests:
    """The group's requests, and which of them are this rank's."""

    prompts: list[list[int]]
    """Every prompt of the group, shards in rank order."""

    samplings: list[SamplingConfig]
    """The sampling parameters of each prompt (those of the shard it came from)."""

    mine: slice
    """This rank's prompts within `prompts`."""

    origins: list[tuple[int, int]]
    """(shard key, position in the shard) of each prompt: what its request's seed follows, so
    that a prompt samples alike whichever instance, and with whichever others, generates it."""

    truncated: int
    """How many of this rank's prompts were truncated."""


def pool_requests(prompts: Sequence[Sequence[int]], sampling: SamplingConfig,
                  prompt_config: PromptConfig, context_length: int, vocab_size: int,
                  shard_key: int, group, engine_problems: Sequence[str] = (),
                  first_position: int = 0) -> PooledRequests:
    """Validate this rank's request, then pool the group's (`group` None: this rank alone).
    first_position: the position of prompts[0] in its data shard (`RolloutEngine.generate`).
    Raises PromptError on every rank of the group if any rank's request is refused."""
    problems, prepared = list(engine_problems), None
    try:
        check_request(sampling, prompt_config, context_length)
        prepared = prepare_prompts(prompts, prompt_config, vocab_size)
    except PromptError as error:
        problems.append(str(error))
    if group is None or dist.get_world_size(group) == 1:
        if problems:
            raise PromptError("; ".join(problems))
        count = len(prepared.token_ids)
        return PooledRequests(prepared.token_ids, [sampling] * count, slice(0, count),
                              _origins(shard_key, first_position, count), prepared.truncated)
    request = (prepared.token_ids if prepared else None, sampling, first_position)
    shares = gather_shares(shard_key, (request, problems), group)
    messages = [f"rank {rank}: {problem}" for rank, _, (_, rank_problems) in shares
                for problem in rank_problems]
    if messages:
        raise PromptError("; ".join(messages))
    by_key = one_share_per_key(shares)
    for rank, key, (rank_request, _) in shares:
        if rank_request != by_key[key][0]:
            raise PromptError(f"rank {rank} shares an engine and data shard {key} with an "
                              "earlier rank of its group but passed a different request")
    pooled, samplings, slices, origins = [], [], {}, []
    for key, ((rank_prompts, rank_sampling, rank_first), _) in by_key.items():
        slices[key] = slice(len(pooled), len(pooled) + len(rank_prompts))
        pooled.extend(rank_prompts)
        samplings.extend([rank_sampling] * len(rank_prompts))
        origins.extend(_origins(key, rank_first, len(rank_prompts)))
    return PooledRequests(pooled, samplings, slices[shard_key], origins, prepared.truncated)


def _origins(shard_key: int, first_position: int, count: int) -> list[tuple[int, int]]:
    return [(shard_key, first_position + offset) for offset in range(count)]


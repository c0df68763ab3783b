"""Pool the prompts of the ranks that share one engine instance.

An engine instance spans a group of ranks (a vLLM rollout-TP group, or the Megatron
model-parallel group) and every rank of it must feed the same batch. Ranks arrive with their own
data-parallel shards: ranks with the same shard key (e.g. TP peers of one training DP rank) must
bring identical prompts, ranks with different keys are concatenated in rank order. Each rank
then takes back its own slice of the results.
"""

from __future__ import annotations

import torch.distributed as dist

from .engine import EngineError


def pool_prompts(prompts: list[list[int]], shard_key: int, group) -> tuple[list[list[int]], slice]:
    """(the group's prompts, the slice of them that is this rank's). `group` None: no pooling."""
    if group is None or dist.get_world_size(group) == 1:
        return prompts, slice(0, len(prompts))
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (shard_key, prompts), group=group)
    pooled, slices, disagreeing = [], {}, []
    ranks = dist.get_process_group_ranks(group)
    for rank, (key, rank_prompts) in zip(ranks, everyone):
        if key in slices:
            if pooled[slices[key]] != rank_prompts:
                disagreeing.append(rank)
            continue
        slices[key] = slice(len(pooled), len(pooled) + len(rank_prompts))
        pooled.extend(rank_prompts)
    if disagreeing:
        raise EngineError(f"ranks {disagreeing} share an engine and a data shard with an earlier "
                          "rank of their group but passed different prompts")
    return pooled, slices[shard_key]


def default_shard_key() -> int:
    """The rank's data shard: its Megatron data-parallel rank when a trainer set up parallel
    state, else its global rank."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_data_parallel_rank()
    return dist.get_rank()

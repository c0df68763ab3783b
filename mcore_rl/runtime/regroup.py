"""Regrouping rows over the ranks of one model copy.

Three places hand work to a group of ranks that must act as one (an engine instance spanning a
rollout-TP group, the leader running a whole instance's agent episodes, one copy of a teacher
in its own layout) while each rank arrives with its own data-parallel shard. Ranks with the
same shard key hold the same rows, which must count once. Each place used to gather and
de-duplicate in its own way; this is the one way.
"""

from __future__ import annotations

from typing import Any, Hashable

import torch.distributed as dist


def gather_shares(key: Hashable, share: Any, group) -> list[tuple[int, Hashable, Any]]:
    """(global rank, shard key, share) of every rank of `group`, in the group's rank order
    (one all_gather_object; collective over `group`)."""
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (key, share), group=group)
    return [(rank, key, share) for rank, (key, share)
            in zip(dist.get_process_group_ranks(group), gathered)]


def one_share_per_key(shares: list[tuple[int, Hashable, Any]]) -> dict[Hashable, Any]:
    """Each key's share as its first rank brought it, keys in the order they first appear."""
    by_key: dict[Hashable, Any] = {}
    for _, key, share in shares:
        by_key.setdefault(key, share)
    return by_key

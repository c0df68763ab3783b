"""Regrouping rows over the ranks of one model copy.

Three places hand work to a group of ranks that must act as one (an engine instance spanning a
rollout-TP group, the leader running a whole instance's agent episodes, one copy of a teacher
in its own layout) while each rank arrives with its own data-parallel shard. Ranks with the
same shard key hold the same rows, which must count once. Each place used to gather and
de-duplicate in its own way; this is the one way. Shares of Python objects (records) travel
pickled (`gather_shares`); shares of tensors under an integer key by tensor collectives on the
group's device, with no pickling per step (`gather_tensor_shares`).
"""

from __future__ import annotations

from typing import Any, Hashable

import torch
import torch.distributed as dist

from .devices import collective_device


def gather_shares(key: Hashable, share: Any, group) -> list[tuple[int, Hashable, Any]]:
    """(global rank, shard key, share) of every rank of `group`, in the group's rank order
    (one all_gather_object; collective over `group`)."""
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (key, share), group=group)
    return [(rank, key, share) for rank, (key, share)
            in zip(dist.get_process_group_ranks(group), gathered)]


def gather_ints(value: int, group) -> list[int]:
    """Every rank's `value`, in the group's rank order (one all_gather of a tensor; collective
    over `group`)."""
    mine = torch.tensor([value], dtype=torch.int64, device=collective_device(group))
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return torch.cat(everyone).tolist()


def gather_tensor_shares(key: int, share: dict[str, torch.Tensor], group
                         ) -> list[tuple[int, int, dict[str, torch.Tensor]]]:
    """`gather_shares` for an integer key and a share of 2-D tensors: the same names and dtypes
    on every rank, any number of rows and columns. By tensor collectives on the group's device
    (collective_device): one all_gather of every rank's key and shapes (read once on the host),
    then one per tensor, padded to the largest; the shares come back on that device, cut to
    their own shapes. Collective over `group`."""
    device = collective_device(group)
    names = sorted(share)
    for name in names:
        if share[name].dim() != 2:
            raise ValueError(f"gather_tensor_shares: {name!r} has shape "
                             f"{tuple(share[name].shape)}; shares are 2-D tensors")
    world = dist.get_world_size(group)
    header = torch.tensor([key, *(size for name in names for size in share[name].shape)],
                          dtype=torch.int64, device=device)
    headers = [torch.empty_like(header) for _ in range(world)]
    dist.all_gather(headers, header, group=group)
    table = torch.stack(headers).tolist()
    shares: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
    for index, name in enumerate(names):
        shapes = [(row[1 + 2 * index], row[2 + 2 * index]) for row in table]
        tensor = share[name]
        wire = tensor.to(torch.uint8) if tensor.dtype == torch.bool else tensor  # NCCL, gloo
        padded = torch.zeros(max(rows for rows, _ in shapes), max(cols for _, cols in shapes),
                             dtype=wire.dtype, device=device)
        padded[:tensor.shape[0], :tensor.shape[1]] = wire
        gathered = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(gathered, padded, group=group)
        for rank, (rows, cols) in enumerate(shapes):
            shares[rank][name] = gathered[rank][:rows, :cols].to(tensor.dtype)
    return [(rank, row[0], rank_share) for rank, row, rank_share
            in zip(dist.get_process_group_ranks(group), table, shares)]


def one_share_per_key(shares: list[tuple[int, Hashable, Any]]) -> dict[Hashable, Any]:
    """Each key's share as its first rank brought it, keys in the order they first appear."""
    by_key: dict[Hashable, Any] = {}
    for _, key, share in shares:
        by_key.setdefault(key, share)
    return by_key

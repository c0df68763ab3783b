"""Masked statistics over the whole data-parallel batch.

Whitening advantages over "the batch" must mean the global batch, or the result depends on how
many DP ranks the batch was split over. Sums, squared sums and counts are all-reduced over
`group` (None: this rank's tensors are the whole batch).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..runtime.devices import collective_device


def masked_sum_count(values: torch.Tensor, mask: torch.Tensor, group=None):
    """(sum, sum of squares, count) of values where mask is 1, over the group, in fp64, on
    the values' device."""
    mask = mask.to(torch.float64)
    values = values.to(torch.float64)
    totals = torch.stack([(values * mask).sum(), (values * values * mask).sum(), mask.sum()])
    if group is not None and dist.get_world_size(group) > 1:
        reduced = totals.to(collective_device(group))
        dist.all_reduce(reduced, group=group)
        totals = reduced.to(values.device)
    return totals[0], totals[1], totals[2]


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, group=None) -> torch.Tensor:
    """(values - mean) / sqrt(unbiased var + 1e-8) over the masked entries (verl's
    `masked_whiten`)."""
    total, squares, count = masked_sum_count(values, mask, group)
    if count < 2:
        raise ValueError(f"whitening needs at least 2 masked values, got {int(count)}")
    mean = total / count
    variance = (squares / count - mean * mean) * count / (count - 1)
    whitened = (values.double() - mean) * torch.rsqrt(variance.clamp(min=0) + 1e-8)
    return whitened.to(values.dtype)

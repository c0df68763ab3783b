"""Data-parallel sequence-length balancing: move rows between DP ranks so that every rank trains
on about the same number of tokens before the RL update.

Why: each data-parallel rank updates on its own rows, and all of them wait for the slowest one
at the gradient all-reduce. RL responses have a long tail of lengths, so a rank that drew a few
very long responses can take several times as long as the others while they idle. Every rank
keeps its number of rows n (micro-batching and the pipeline schedules need it) but the rows are
redistributed so that the tokens per rank (sum of `attention_mask`) are as equal as possible,
moving only the rows that change rank (the idea of verl's `balance_batch`).

How:
- `exchange_rows` sends only the rows that change rank with point-to-point ops, one message per
  (source, destination, tensor); sequence tensors travel trimmed to the longest row in the
  message and the receiver re-pads to the longest row it now holds.
- `balance_over_data_parallel` plans (`training.balance_plan`), exchanges and returns
  before/after statistics.

Batch layout: a dict of tensors that all have the same number of rows n (dim 0), with a right-padded
`attention_mask` [n, s] (ones, then zeros; a row's length is its sum). A tensor is a *sequence
tensor* when it has at least two dimensions and its dim 1 equals the mask's width s ([n, s] or [n,
s, ...]); it is trimmed and re-padded along dim 1, and in the result every position past its row's
length is zero (`routed_experts`: NO_ROUTE, no route given, which a zero would turn into k copies of
expert 0). Every other tensor ([n], or [n, k, ...] with k != s) moves whole rows and must have the
same trailing shape on every rank. Keys and dtypes must agree over the group; different ranks may
have different widths s.

Every tensor-parallel / pipeline rank of one DP position holds the same rows and the same
lengths, so each of them calling this over its own DP group computes the same plan and they stay
consistent with each other.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..models.moe_routing import NO_ROUTE
from ..runtime.devices import collective_device
from .balance_plan import (Assignment, balanced_assignment, max_over_mean, rank_tokens,
                           rows_moved, unchanged)

Batch = dict[str, torch.Tensor]
MASK = "attention_mask"
PADDING = {"routed_experts": NO_ROUTE}
"""What a sequence tensor holds past its row's length, where not 0."""


# ----------------------------------------------------------------------------- the exchange

def exchange_rows(batch: Batch, assignment: Assignment, group) -> Batch:
    """Collective over the DP process group `group` (None: the world): every rank passes its own
    batch and the same assignment and gets back the rows the assignment gives it, same keys and
    dtypes, n rows, right-padded to the longest row it now holds (zeros past each row's length).

    A malformed batch or assignment raises ValueError before any communication; batches that
    disagree over the group (keys, dtypes, row count, shapes) raise ValueError on every rank
    after one small all-gather of their descriptions, before any row moves."""
    group = _world_if_none(group)
    description = describe(batch)
    _check_assignment(assignment, dist.get_world_size(group), len(description["lengths"]))
    descriptions = _gather_descriptions(description, group)
    return _exchange(batch, assignment, group, [entry["lengths"] for entry in descriptions])


def describe(batch: Batch) -> dict:
    """This rank's row lengths and the layout of its tensors; ValueError for a malformed batch."""
    if MASK not in batch:
        raise ValueError(f"batch needs '{MASK}', got {sorted(batch)}")
    mask = batch[MASK]
    if mask.dim() != 2:
        raise ValueError(f"'{MASK}' must be [num_rows, seq_length], got {tuple(mask.shape)}")
    rows, width = mask.shape
    for name, tensor in batch.items():
        if tensor.dim() == 0 or tensor.shape[0] != rows:
            raise ValueError(f"batch tensor '{name}' has shape {tuple(tensor.shape)}, "
                             f"'{MASK}' has {rows} rows")
    valid = mask != 0
    lengths = valid.sum(dim=1)
    if not torch.equal(valid, torch.arange(width, device=mask.device) < lengths.unsqueeze(1)):
        raise ValueError(f"'{MASK}' must be right-padded: ones, then only zeros")
    layout = {name: (str(tensor.dtype), _is_sequence(tensor, width),
                     tuple(tensor.shape[2:] if _is_sequence(tensor, width) else tensor.shape[1:]))
              for name, tensor in sorted(batch.items())}
    return {"lengths": lengths.tolist(), "layout": layout}


def _is_sequence(tensor: torch.Tensor, width: int) -> bool:
    return tensor.dim() >= 2 and tensor.shape[1] == width


def _check_assignment(assignment: Assignment, ranks: int, rows: int) -> None:
    if len(assignment) != ranks:
        raise ValueError(f"assignment has {len(assignment)} destinations, the group {ranks}")
    if any(len(group) != rows for group in assignment):
        raise ValueError(f"every destination must receive exactly {rows} rows, got "
                         f"{[len(group) for group in assignment]}")
    used = sorted(tuple(item) for group in assignment for item in group)
    if used != [(rank, row) for rank in range(ranks) for row in range(rows)]:
        raise ValueError("assignment must use every (source_rank, source_row) exactly once")


def _world_if_none(group):
    return dist.group.WORLD if group is None else group


def _gather_descriptions(description: dict, group) -> list[dict]:
    """Every rank's description; ValueError on every rank when they disagree."""
    descriptions: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(descriptions, description, group=group)
    counts = [len(entry["lengths"]) for entry in descriptions]
    if len(set(counts)) != 1:
        raise ValueError(f"data-parallel ranks hold different numbers of rows: {counts}")
    layouts = [entry["layout"] for entry in descriptions]
    if any(layout != layouts[0] for layout in layouts):
        raise ValueError(f"data-parallel ranks disagree on the batch layout "
                         f"(name: dtype, is sequence tensor, trailing shape): {layouts}")
    return descriptions


def _exchange(batch: Batch, assignment: Assignment, group, lengths: list[list[int]]) -> Batch:
    """Post every send and receive of this rank at once, wait, and build the new batch."""
    ranks = dist.get_process_group_ranks(group)
    me = ranks.index(dist.get_rank())
    device = collective_device(group)
    ops, inbox = [], []
    for peer in range(len(ranks)):
        if peer != me:
            ops += _sends(batch, assignment[peer], me, lengths[me], device, ranks[peer], group)
            ops += _receives(batch, assignment[me], peer, lengths[peer], device, ranks[peer],
                             group, inbox)
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    new_lengths = [lengths[rank][row] for rank, row in assignment[me]]
    return _assemble(batch, assignment[me], me, new_lengths, inbox)


def _sends(batch: Batch, theirs: list[tuple[int, int]], me: int, my_lengths: list[int],
           device: torch.device, peer: int, group) -> list:
    """One isend per tensor of the rows that `peer` (global rank) gets from this rank, in its
    order; sequence tensors trimmed to the longest of those rows. Tag: the tensor's index."""
    rows = [row for rank, row in theirs if rank == me]
    ops = []
    for tag, name in enumerate(sorted(batch)):
        tensor = batch[name]
        payload = _take_rows(tensor, rows, _trim(my_lengths, rows, tensor, _width(batch)))
        if payload.numel():
            ops.append(dist.P2POp(dist.isend, payload.to(device), peer, group, tag))
    return ops


def _receives(batch: Batch, mine: list[tuple[int, int]], source: int, source_lengths: list[int],
              device: torch.device, peer: int, group, inbox: list) -> list:
    """The irecvs matching `_sends` on group rank `source` (global rank `peer`); appends
    (name, positions in this rank's new batch, buffer) to `inbox`."""
    positions = [index for index, (rank, _) in enumerate(mine) if rank == source]
    rows = [row for rank, row in mine if rank == source]
    ops = []
    for tag, name in enumerate(sorted(batch)):
        tensor = batch[name]
        trim = _trim(source_lengths, rows, tensor, _width(batch))
        buffer = torch.empty((len(rows), *_row_shape(tensor, trim)), dtype=tensor.dtype,
                             device=device)
        if buffer.numel():
            ops.append(dist.P2POp(dist.irecv, buffer, peer, group, tag))
            inbox.append((name, positions, buffer))
    return ops


def _width(batch: Batch) -> int:
    return batch[MASK].shape[1]


def _trim(lengths: list[int], rows: list[int], tensor: torch.Tensor, width: int) -> int | None:
    """Width a message of `rows` needs for a sequence tensor (None: not a sequence tensor)."""
    if not _is_sequence(tensor, width):
        return None
    return max((lengths[row] for row in rows), default=0)


def _row_shape(tensor: torch.Tensor, trim: int | None) -> tuple[int, ...]:
    return tuple(tensor.shape[1:]) if trim is None else (trim, *tensor.shape[2:])


def _take_rows(tensor: torch.Tensor, rows: list[int], trim: int | None) -> torch.Tensor:
    index = torch.tensor(rows, dtype=torch.long, device=tensor.device)
    taken = tensor.index_select(0, index)
    return (taken if trim is None else taken[:, :trim]).contiguous()


def _assemble(batch: Batch, mine: list[tuple[int, int]], me: int, new_lengths: list[int],
              inbox: list) -> Batch:
    """This rank's new batch: kept rows copied, received rows placed, padding past each length."""
    width, new_width = _width(batch), max(new_lengths, default=0)
    kept = [index for index, (rank, _) in enumerate(mine) if rank == me]
    kept_rows = [row for rank, row in mine if rank == me]
    result = {}
    for name, tensor in batch.items():
        sequence = _is_sequence(tensor, width)
        shape = (len(mine), *_row_shape(tensor, new_width if sequence else None))
        result[name] = out = torch.zeros(shape, dtype=tensor.dtype, device=tensor.device)
        if kept:
            _place(out, kept, _take_rows(tensor, kept_rows, min(new_width, width)
                                         if sequence else None), sequence)
    for name, positions, buffer in inbox:
        _place(result[name], positions, buffer, _is_sequence(batch[name], width))
    return {name: _padded(out, new_lengths, PADDING.get(name, 0))
            if _is_sequence(batch[name], width) else out for name, out in result.items()}


def _place(out: torch.Tensor, positions: list[int], rows: torch.Tensor, sequence: bool) -> None:
    """out[positions] = rows; sequence rows may be narrower (they fill the leading columns)."""
    index = torch.tensor(positions, dtype=torch.long, device=out.device)
    rows = rows.to(out.device)
    if sequence:
        out[index, :rows.shape[1]] = rows
    else:
        out[index] = rows


def _padded(tensor: torch.Tensor, lengths: list[int], value: int) -> torch.Tensor:
    """`tensor` with `value` at every position past its row's length."""
    limits = torch.tensor(lengths, dtype=torch.long, device=tensor.device)
    valid = torch.arange(tensor.shape[1], device=tensor.device) < limits.unsqueeze(1)
    valid = valid.reshape(*valid.shape, *([1] * (tensor.dim() - 2)))
    return torch.where(valid, tensor, torch.full((), value, dtype=tensor.dtype,
                                                 device=tensor.device))


# ----------------------------------------------------------------------------- both

def balance_over_data_parallel(batch: Batch, group) -> tuple[Batch, dict]:
    """Redistribute rows over the DP group `group` (None: the world) so that every rank holds n
    rows and about the same number of tokens. Returns the new batch and statistics, identical on
    every rank: balance/tokens_max_over_mean_before, balance/tokens_max_over_mean_after,
    balance/rows_moved. A group of one returns the batch unchanged without communicating."""
    group = _world_if_none(group)
    description = describe(batch)
    if dist.get_world_size(group) == 1:
        lengths = [description["lengths"]]
        return batch, _stats(lengths, unchanged(lengths))
    descriptions = _gather_descriptions(description, group)
    lengths = [entry["lengths"] for entry in descriptions]
    assignment = balanced_assignment(lengths)
    return _exchange(batch, assignment, group, lengths), _stats(lengths, assignment)


def _stats(lengths: list[list[int]], assignment: Assignment) -> dict:
    return {"balance/tokens_max_over_mean_before": max_over_mean([sum(rows) for rows in lengths]),
            "balance/tokens_max_over_mean_after": max_over_mean(rank_tokens(assignment, lengths)),
            "balance/rows_moved": rows_moved(assignment)}

"""Data-parallel sequence-length balancing: move rows between DP ranks so that every rank trains
on about the same number of tokens before the RL update.

Why: each data-parallel rank updates on its own rows, and all of them wait for the slowest one
at the gradient all-reduce. RL responses have a long tail of lengths, so a rank that drew a few
very long responses can take several times as long as the others while they idle. Every rank
keeps its number of rows n (micro-batching and the pipeline schedules need it) but the rows are
redistributed so that the tokens per rank (sum of `attention_mask`) are as equal as possible,
moving only the rows that change rank (the idea of verl's `balance_batch`).

How:
- `balanced_assignment` is a pure function of every rank's row lengths (all-gathered, so every
  rank computes the identical plan; integer arithmetic, one pure-Python implementation on every
  rank, no optional dependency such as scipy whose presence could differ between ranks). Two
  plans compete with "move nothing": (a) longest-processing-time greedy under the cardinality
  constraint (n rows per rank), its groups relabeled so that each rank keeps as many of its own
  rows as possible (exact maximum-weight matching, Hungarian algorithm); (b) a local search of
  row swaps between the most loaded rank and a lighter one, starting from where the rows are.
  The winner has the fewest tokens on the most loaded rank (the one everybody waits for), then
  the fewest rows moved. (a) carries the bound below; (b) usually ties it while moving far
  fewer rows (measured on heavy-tailed lengths: 8 ranks x 64 rows, 49 rows moved instead of
  401; 64 x 256: about 400 instead of 13,600), since LPT rebuilds the groups from scratch.
- `exchange_rows` sends only the rows that change rank with point-to-point ops, one message per
  (source, destination, tensor); sequence tensors travel trimmed to the longest row in the
  message and the receiver re-pads to the longest row it now holds.
- `balance_over_data_parallel` does both and returns before/after statistics.

Batch layout: a dict of tensors that all have the same number of rows n (dim 0), with a
right-padded `attention_mask` [n, s] (ones, then zeros; a row's length is its sum). A tensor is
a *sequence tensor* when it has at least two dimensions and its dim 1 equals the mask's width s
([n, s] or [n, s, ...]); it is trimmed and re-padded along dim 1, and in the result every
position past its row's length is zero. Every other tensor ([n], or [n, k, ...] with k != s) moves
whole rows and must have the same trailing shape on every rank. Keys and dtypes must agree over
the group; different ranks may have different widths s.

Bound (plan (a), m ranks): the most loaded rank gets at most mean + (1 - 1/m) * longest_row
tokens, hence at most optimum + longest_row, and the returned plan is never worse than (a) nor
than not balancing. This is the classic list-scheduling bound; under the cardinality constraint
it was checked (against exhaustively enumerated optima of small instances and by adversarial
search), not proven here. The mean form is tight (rows (47, 47), (0, 47), (47, 0) on three
ranks); against the optimum the largest gap found was 0.44 * longest_row. Loads are tokens, not
attention cost (quadratic in length), as in verl.

Every tensor-parallel / pipeline rank of one DP position holds the same rows and the same
lengths, so each of them calling this over its own DP group computes the same plan and they stay
consistent with each other.
"""

from __future__ import annotations

import bisect
import heapq

import torch
import torch.distributed as dist

from ..runtime.devices import collective_device

Batch = dict[str, torch.Tensor]
Assignment = list[list[tuple[int, int]]]
"""For each destination rank, the (source_rank, source_row) it holds, in its row order."""

MASK = "attention_mask"


# ----------------------------------------------------------------------------- the plan

def balanced_assignment(lengths: list[list[int]]) -> Assignment:
    """Which rows every DP rank holds after balancing: for each destination rank, the list of
    (source_rank, source_row), exactly n per destination, every source row once.

    `lengths[r][i]` is the length of row i on rank r (every rank has the same n). Deterministic:
    the same input gives the same output on every rank. Of three candidates (nothing moves;
    swaps from the current placement; the relabeled LPT partition) it returns the one with the
    fewest tokens on the most loaded rank, then the fewest rows moved, then the first. Within a
    destination its own rows come first in their original order, then received rows ordered by
    (source_rank, source_row)."""
    _check_lengths(lengths)
    candidates = [_unchanged(lengths), _swap_search(lengths), _relabel(_lpt_groups(lengths), len(lengths))]
    best = min(candidates, key=lambda plan: (max(rank_tokens(plan, lengths)), rows_moved(plan)))
    return [sorted(group, key=lambda item, dest=dest: (item[0] != dest, item))
            for dest, group in enumerate(best)]


def _check_lengths(lengths: list[list[int]]) -> None:
    if not lengths:
        raise ValueError("lengths needs one list per data-parallel rank, got none")
    counts = {len(rows) for rows in lengths}
    if len(counts) != 1:
        raise ValueError(f"every rank must hold the same number of rows, got {sorted(counts)}")
    if any(not isinstance(length, int) or length < 0 for rows in lengths for length in rows):
        raise ValueError("row lengths must be non-negative Python ints")


def _unchanged(lengths: list[list[int]]) -> Assignment:
    """The plan that moves nothing."""
    return [[(rank, row) for row in range(len(rows))] for rank, rows in enumerate(lengths)]


def _lpt_groups(lengths: list[list[int]]) -> Assignment:
    """Longest-processing-time greedy with equal group sizes: rows by length, longest first
    (ties by source rank, then row), each to the group with the fewest tokens among those with
    fewer than n rows; on equal tokens the row's own rank, then the lowest index."""
    ranks, rows = len(lengths), len(lengths[0])
    order = sorted(((-length, rank, row) for rank, values in enumerate(lengths)
                    for row, length in enumerate(values)))
    loads, counts, versions = [0] * ranks, [0] * ranks, [0] * ranks
    heap = [(0, dest, 0) for dest in range(ranks)]  # (load, dest, version): stale if old
    groups: Assignment = [[] for _ in range(ranks)]
    for negative, rank, row in order:
        while heap[0][2] != versions[heap[0][1]]:
            heapq.heappop(heap)
        lightest = heap[0][0]
        dest = rank if counts[rank] < rows and loads[rank] == lightest else heap[0][1]
        groups[dest].append((rank, row))
        loads[dest] -= negative
        counts[dest] += 1
        versions[dest] += 1
        if counts[dest] < rows:
            heapq.heappush(heap, (loads[dest], dest, versions[dest]))
    return groups


def _relabel(groups: Assignment, ranks: int) -> Assignment:
    """The groups reordered so that group d goes to the rank that already holds most of its
    rows (groups are interchangeable: this only changes how many rows move)."""
    overlap = [[0] * ranks for _ in range(ranks)]
    for index, group in enumerate(groups):
        for rank, _ in group:
            overlap[index][rank] += 1
    rank_of_group = max_weight_matching(overlap)
    relabeled: Assignment = [[] for _ in range(ranks)]
    for index, rank in enumerate(rank_of_group):
        relabeled[rank] = groups[index]
    return relabeled


def _swap_search(lengths: list[list[int]]) -> Assignment:
    """Local search from the current placement, which moves few rows: repeatedly swap one row
    of the most loaded rank with one row of the lightest rank that has an improving swap (the
    pair's larger load ends as small as possible). Every swap lowers the loads sorted largest
    first, lexicographically, so it ends; the cap on swaps is only a safeguard."""
    ranks = len(lengths)
    groups = _unchanged(lengths)
    loads = [sum(values) for values in lengths]
    for _ in range(ranks * len(lengths[0])):
        heavy = min(range(ranks), key=lambda dest: (-loads[dest], dest))
        swap = None
        for light in sorted(range(ranks), key=lambda dest: (loads[dest], dest)):
            if loads[light] >= loads[heavy]:
                break
            swap = _best_swap(groups[heavy], groups[light], loads[heavy] - loads[light], lengths)
            if swap is not None:
                break
        if swap is None:
            break
        mine, theirs, delta = swap
        groups[heavy][mine], groups[light][theirs] = groups[light][theirs], groups[heavy][mine]
        loads[heavy] -= delta
        loads[light] += delta
    return groups


def _best_swap(heavy: list[tuple[int, int]], light: list[tuple[int, int]], gap: int,
               lengths: list[list[int]]) -> tuple[int, int, int] | None:
    """(position in heavy, position in light, length difference d) for the swap with 0 < d < gap
    whose d is closest to gap / 2, or None. Ties: lowest positions."""
    candidates = sorted((lengths[rank][row], index) for index, (rank, row) in enumerate(light))
    keys = [length for length, _ in candidates]
    best = None
    for mine, (rank, row) in enumerate(heavy):
        length = lengths[rank][row]
        nearest = bisect.bisect_left(keys, length - gap / 2)
        for near in (nearest - 1, nearest):
            if 0 <= near < len(keys) and 0 < length - keys[near] < gap:
                delta = length - keys[near]
                key = (max(delta, gap - delta), mine, candidates[near][1])
                if best is None or key < best[0]:
                    best = (key, delta)
    return None if best is None else (best[0][1], best[0][2], best[1])


def max_weight_matching(weight: list[list[int]]) -> list[int]:
    """A perfect matching of rows to columns of a square integer matrix with the largest total
    weight: result[i] is row i's column (Hungarian algorithm, O(m^3), exact integer arithmetic,
    deterministic)."""
    size = len(weight)
    cost = [[-value for value in row] for row in weight]
    infinity = float("inf")
    u, v = [0] * (size + 1), [0] * (size + 1)
    match, way = [0] * (size + 1), [0] * (size + 1)  # match[column] = row (1-based, 0 = none)
    for row in range(1, size + 1):
        match[0], column = row, 0
        best, used = [infinity] * (size + 1), [False] * (size + 1)
        while match[column]:
            used[column] = True
            current, delta, nearest = match[column], infinity, 0
            for other in range(1, size + 1):
                if used[other]:
                    continue
                reduced = cost[current - 1][other - 1] - u[current] - v[other]
                if reduced < best[other]:
                    best[other], way[other] = reduced, column
                if best[other] < delta:
                    delta, nearest = best[other], other
            for other in range(size + 1):
                if used[other]:
                    u[match[other]] += delta
                    v[other] -= delta
                else:
                    best[other] -= delta
            column = nearest
        while column:
            previous = way[column]
            match[column] = match[previous]
            column = previous
    result = [0] * size
    for column in range(1, size + 1):
        result[match[column] - 1] = column - 1
    return result


def rank_tokens(assignment: Assignment, lengths: list[list[int]]) -> list[int]:
    """Tokens each destination holds under `assignment`."""
    return [sum(lengths[rank][row] for rank, row in group) for group in assignment]


def rows_moved(assignment: Assignment) -> int:
    """How many rows change rank under `assignment`."""
    return sum(rank != dest for dest, group in enumerate(assignment) for rank, _ in group)


def max_over_mean(tokens: list[int]) -> float:
    """The most loaded rank's tokens over the mean (1.0 for no tokens at all)."""
    total = sum(tokens)
    return max(tokens) * len(tokens) / total if total else 1.0


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
    """This rank's new batch: kept rows copied, received rows placed, zeros past each length."""
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
    return {name: _zero_padding(out, new_lengths) if _is_sequence(batch[name], width) else out
            for name, out in result.items()}


def _place(out: torch.Tensor, positions: list[int], rows: torch.Tensor, sequence: bool) -> None:
    """out[positions] = rows; sequence rows may be narrower (they fill the leading columns)."""
    index = torch.tensor(positions, dtype=torch.long, device=out.device)
    rows = rows.to(out.device)
    if sequence:
        out[index, :rows.shape[1]] = rows
    else:
        out[index] = rows


def _zero_padding(tensor: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    limits = torch.tensor(lengths, dtype=torch.long, device=tensor.device)
    valid = torch.arange(tensor.shape[1], device=tensor.device) < limits.unsqueeze(1)
    valid = valid.reshape(*valid.shape, *([1] * (tensor.dim() - 2)))
    return torch.where(valid, tensor, torch.zeros((), dtype=tensor.dtype, device=tensor.device))


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
        return batch, _stats(lengths, _unchanged(lengths))
    descriptions = _gather_descriptions(description, group)
    lengths = [entry["lengths"] for entry in descriptions]
    assignment = balanced_assignment(lengths)
    return _exchange(batch, assignment, group, lengths), _stats(lengths, assignment)


def _stats(lengths: list[list[int]], assignment: Assignment) -> dict:
    return {"balance/tokens_max_over_mean_before": max_over_mean([sum(rows) for rows in lengths]),
            "balance/tokens_max_over_mean_after": max_over_mean(rank_tokens(assignment, lengths)),
            "balance/rows_moved": rows_moved(assignment)}

"""The balancing plan: which data-parallel rank trains on which rows, as a pure function of
every rank's row lengths (no communication; see training.balance for the exchange and why).

`balanced_assignment` takes every rank's row lengths (all-gathered, so every rank computes the identical plan; integer arithmetic, one pure-Python implementation on every
rank, no optional dependency such as scipy whose presence could differ between ranks). Two
plans compete with "move nothing": (a) longest-processing-time greedy under the cardinality
constraint (n rows per rank), its groups relabeled so that each rank keeps as many of its own
rows as possible (exact maximum-weight matching, Hungarian algorithm); (b) a local search of
row swaps between the most loaded rank and a lighter one, starting from where the rows are.
The winner has the fewest tokens on the most loaded rank (the one everybody waits for), then
the fewest rows moved. (a) carries the bound below; (b) usually ties it while moving far
fewer rows (measured on heavy-tailed lengths: 8 ranks x 64 rows, 49 rows moved instead of
401; 64 x 256: about 400 instead of 13,600), since LPT rebuilds the groups from scratch.

Bound (plan (a), m ranks): the most loaded rank gets at most mean + (1 - 1/m) * longest_row
tokens, hence at most optimum + longest_row, and the returned plan is never worse than (a) nor
than not balancing. This is the classic list-scheduling bound; under the cardinality constraint
it was checked (against exhaustively enumerated optima of small instances and by adversarial
search), not proven here. The mean form is tight (rows (47, 47), (0, 47), (47, 0) on three
ranks); against the optimum the largest gap found was 0.44 * longest_row. Loads are tokens, not
attention cost (quadratic in length), as in verl.
"""

from __future__ import annotations

import bisect
import heapq

Assignment = list[list[tuple[int, int]]]
"""For each destination rank, the (source_rank, source_row) it holds, in its row order."""


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
    candidates = [unchanged(lengths), _swap_search(lengths),
                  _relabel(_lpt_groups(lengths), len(lengths))]
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


def unchanged(lengths: list[list[int]]) -> Assignment:
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
    groups = unchanged(lengths)
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

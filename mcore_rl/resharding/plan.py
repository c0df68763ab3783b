"""The transfer plan: which rows of which parameter go from which rank to which rank.

Why a pure plan
---------------
Planning uses only the model config, the two layouts and the dtype - no communication - so
every rank computes the same plan independently (`ReshardPlan.digest` lets a test prove it), the
same code sizes a 1000-GPU job on a laptop (`dry_run`), and errors in the input surface before
any byte moves. The plan is the minimum: a rank receives exactly the rows of its rollout shard
it does not already hold (zero redundancy), each from one holder; rows it holds are copied
locally; padding rows are zero-filled, never sent.

Choosing the sender
-------------------
A row is usually held by several ranks (the DP replicas of a training shard; every rank of a
stage for replicated norms). The sender is chosen per receiver, deterministically: holders on
the receiver's node first (fast links), then the one that has sent least of this parameter so
far, so replicas share the load. The choice depends only on the parameter's geometry, so all
layers of a pipeline stage share one cached plan: planning a 405B model over 896 ranks takes
about 25 s on one CPU core.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np
import torch

from mcore_rl.param_layout import sharding

from .layouts import ENGINES, RolloutLayout, TrainingLayout
from .shards import Interval, ShardSpec, split_dim


class PlanError(ValueError):
    """The layouts or parameter metadata cannot be resharded; raised before any byte moves."""


@dataclass(frozen=True)
class Transfer:
    """A contiguous run of rows along the parameter's split dimension."""

    src: int
    """Rank that holds the rows (in its training shard)."""

    dst: int
    """Rank that wants them (in its rollout shard)."""

    src_offset: int
    """Start of the run inside the sender's tensor."""

    dst_offset: int
    """Start of the run inside the receiver's tensor."""

    length: int
    """Rows in the run."""


@dataclass(frozen=True)
class ParamPlan:
    """Every transfer of one canonical parameter (remote ones and local copies)."""

    source: str
    """Canonical parameter name."""

    full_shape: tuple
    """Canonical full shape."""

    dim: int
    """Split dimension the offsets and lengths refer to."""

    transfers: tuple[Transfer, ...]
    """Runs that cross ranks (src != dst)."""

    local_copies: tuple[Transfer, ...]
    """Runs a rank already holds (src == dst)."""

    @functools.cached_property
    def row_elements(self) -> int:
        """Elements per row along ``dim`` (product of the other dimensions)."""
        return math.prod(self.full_shape) // self.full_shape[self.dim]


@dataclass
class ReshardPlan:
    """The full plan from a training layout to a rollout layout, in canonical parameter order."""

    training: TrainingLayout
    rollout: RolloutLayout
    dtype: torch.dtype
    params: list[ParamPlan] = field(default_factory=list)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def digest(self) -> str:
        """A hash of every transfer, equal on every rank iff the plans are identical."""
        hasher = hashlib.sha256(repr((self.training, self.rollout, self.dtype)).encode())
        for param in self.params:
            hasher.update(repr((param.source, param.transfers, param.local_copies)).encode())
        return hasher.hexdigest()

    def wanted_shapes(self, rank: int) -> dict[str, tuple]:
        """Engine name -> shape of every shard ``rank`` receives."""
        full = {param.source: param.full_shape for param in self.params}
        return {spec.name: spec.shape(full[source])
                for source, spec in self.rollout.wanted(rank).items()}

    @property
    def job_world_size(self) -> int:
        return job_world_size(self.training, self.rollout)

    def traffic(self) -> "Traffic":
        """Bytes each rank receives and sends under this plan."""
        return traffic_of(self.params, self.job_world_size, self.element_size)

    def buckets(self, bucket_bytes: int) -> list[list["BucketEntry"]]:
        """The transfers in rounds: on every rank, the bytes sent plus received in one round stay
        within ``bucket_bytes``. Parameters keep their order; a parameter may be spread over
        consecutive rounds (a run longer than the budget is cut into row chunks), and every
        parameter appears at least once, even with nothing to transfer. Computed from the global
        plan, so identical on every rank."""
        element = self.element_size
        buckets: list[list[BucketEntry]] = [[]]
        load = [0] * self.job_world_size
        bucket_is_empty = True
        for param in self.params:
            row_bytes = param.row_elements * element
            max_rows = max(1, bucket_bytes // row_bytes)
            runs: list[Transfer] = []
            for transfer in param.transfers:
                for run in _cut_rows(transfer, max_rows):
                    cost = run.length * row_bytes
                    over = max(load[run.src], load[run.dst]) + cost > bucket_bytes
                    if over and not bucket_is_empty:
                        if runs:
                            buckets[-1].append((param, tuple(runs)))
                        buckets.append([])
                        load = [0] * len(load)
                        runs = []
                        bucket_is_empty = True
                    load[run.src] += cost
                    load[run.dst] += cost
                    bucket_is_empty = False
                    runs.append(run)
            buckets[-1].append((param, tuple(runs)))
        return buckets


def job_world_size(training: TrainingLayout, rollout: RolloutLayout) -> int:
    """Ranks two layouts span: the training ranks, and the rollout ranks after them in split
    placement."""
    return max(training.world_size, rollout.ranks.stop)


BucketEntry = tuple[ParamPlan, tuple[Transfer, ...]]
"""A parameter and the share of its transfers that one bucket carries."""


def _cut_rows(transfer: Transfer, max_rows: int) -> Iterable[Transfer]:
    """``transfer`` as consecutive runs of at most ``max_rows`` rows."""
    if transfer.length <= max_rows:
        return (transfer,)
    return _row_chunks(transfer, max_rows)


def _row_chunks(transfer: Transfer, max_rows: int) -> Iterable[Transfer]:
    for first in range(0, transfer.length, max_rows):
        length = min(max_rows, transfer.length - first)
        yield Transfer(transfer.src, transfer.dst, transfer.src_offset + first,
                       transfer.dst_offset + first, length)


def bucket_load(entries: Iterable[BucketEntry], world: int, element_size: int) -> np.ndarray:
    """Bytes each rank sends plus receives in one bucket."""
    load = [0] * world
    for param, runs in entries:
        row_bytes = param.row_elements * element_size
        for run in runs:
            load[run.src] += run.length * row_bytes
            load[run.dst] += run.length * row_bytes
    return np.array(load, dtype=np.int64)


@dataclass
class Traffic:
    """Per-rank byte counts of a plan (numpy arrays indexed by rank)."""

    received: np.ndarray
    sent: np.ndarray
    received_off_node: np.ndarray
    """Part of ``received`` that comes from another node (zero when nodes are not given)."""
    sent_off_node: np.ndarray


def traffic_of(params: Iterable[ParamPlan], world: int, element_size: int,
               gpus_per_node: int | None = None) -> Traffic:
    """Bytes received and sent per rank (and how much of it crosses nodes) for ``params``.
    Identical parameter plans (shared by all layers of a stage) are counted once and scaled."""
    received, sent = np.zeros(world, np.int64), np.zeros(world, np.int64)
    received_off, sent_off = np.zeros(world, np.int64), np.zeros(world, np.int64)
    counts: dict[int, int] = {}
    by_id: dict[int, ParamPlan] = {}
    for param in params:
        key = id(param.transfers)
        counts[key] = counts.get(key, 0) + 1
        by_id[key] = param
    for key, param in by_id.items():
        scale = counts[key] * param.row_elements * element_size
        for transfer in param.transfers:
            received[transfer.dst] += transfer.length * scale
            sent[transfer.src] += transfer.length * scale
            if gpus_per_node and transfer.src // gpus_per_node != transfer.dst // gpus_per_node:
                received_off[transfer.dst] += transfer.length * scale
                sent_off[transfer.src] += transfer.length * scale
    return Traffic(received, sent, received_off, sent_off)


# --------------------------------------------------------------------------------------------
# Interval arithmetic
# --------------------------------------------------------------------------------------------

def _overlap(a: Interval, b: Interval) -> Interval | None:
    start, stop = max(a[0], b[0]), min(a[1], b[1])
    return (start, stop) if start < stop else None


def held_rows(held: ShardSpec | None, wanted: ShardSpec) -> int:
    """Rows of ``wanted`` that ``held`` (same parameter, same rank) already contains."""
    if held is None:
        return 0
    overlaps = (_overlap(w, h) for w in wanted.pieces for h in held.pieces)
    return sum(stop - start for start, stop in filter(None, overlaps))


@dataclass(frozen=True)
class _Holding:
    """Canonical rows [start, stop) that ``ranks`` all hold at ``offset`` in their tensor."""

    start: int
    stop: int
    offset: int
    ranks: tuple[int, ...]


def _holdings(training: TrainingLayout, source: str) -> list[_Holding]:
    """Every canonical interval of ``source`` any training rank holds, grouped by identical
    placement (DP replicas, and every TP rank for replicated tensors, share one holding)."""
    by_placement: dict[tuple, list[int]] = {}
    for rank in range(training.world_size):
        spec = training.held(rank).get(source)
        if spec is not None:
            for placed in spec.placed_pieces():
                by_placement.setdefault(placed, []).append(rank)
    return [_Holding(start, stop, offset, tuple(ranks))
            for (start, stop, offset), ranks in by_placement.items()]


def _choose_sender(candidates: tuple[int, ...], dst: int, gpus_per_node: int,
                   sent_rows: dict[int, int]) -> int:
    """The holder that sends to ``dst``: ``dst`` itself if it holds the rows, else one on its
    node if any; among those, the one that has sent the fewest rows of this parameter so far
    (lowest rank on ties), so replicas share the load."""
    if dst in candidates:
        return dst
    same_node = [rank for rank in candidates if rank // gpus_per_node == dst // gpus_per_node]
    return min(same_node or candidates, key=lambda rank: (sent_rows.get(rank, 0), rank))


def _runs_for_piece(piece: Interval, dst_offset: int, holdings: list[_Holding], dst: int,
                    gpus_per_node: int, source: str, sent_rows: dict[int, int]) -> list[Transfer]:
    """Transfers covering canonical ``piece`` of ``dst``'s tensor (placed at ``dst_offset``)."""
    cuts = {piece[0], piece[1]}
    for holding in holdings:
        if _overlap(piece, (holding.start, holding.stop)):
            cuts.update(point for point in (holding.start, holding.stop)
                        if piece[0] < point < piece[1])
    points = sorted(cuts)
    runs: list[Transfer] = []
    for start, stop in zip(points, points[1:]):
        covering = [h for h in holdings if h.start <= start and stop <= h.stop]
        if not covering:
            raise PlanError(f"parameter {source!r}: rows [{start}, {stop}) along its split "
                            "dimension are held by no training rank")
        candidates = tuple(sorted({rank for h in covering for rank in h.ranks}))
        src = _choose_sender(candidates, dst, gpus_per_node, sent_rows)
        if src != dst:
            sent_rows[src] = sent_rows.get(src, 0) + stop - start
        holding = next(h for h in covering if src in h.ranks)
        src_offset = holding.offset + start - holding.start
        run = Transfer(src, dst, src_offset, dst_offset + start - piece[0], stop - start)
        previous = runs[-1] if runs else None
        if (previous and previous.src == src and previous.src_offset + previous.length == src_offset
                and previous.dst_offset + previous.length == run.dst_offset):
            runs[-1] = Transfer(src, dst, previous.src_offset, previous.dst_offset,
                                previous.length + run.length)
        else:
            runs.append(run)
    return runs


def _plan_param(training: TrainingLayout, rollout: RolloutLayout, source: str,
                gpus_per_node: int) -> ParamPlan:
    """The transfers of one parameter."""
    holdings = _holdings(training, source)
    remote, local = [], []
    sent_rows: dict[int, int] = {}
    for dst in rollout.ranks:
        wanted = rollout.wanted(dst).get(source)  # None: an expert the rank does not serve
        if wanted is None:
            continue
        for start, stop, offset in wanted.placed_pieces():
            for run in _runs_for_piece((start, stop), offset, holdings, dst, gpus_per_node,
                                       source, sent_rows):
                (local if run.src == dst else remote).append(run)
    shape = sharding.full_shape(source, training.model)
    return ParamPlan(source, shape, split_dim(source), tuple(remote), tuple(local))


def _geometry_key(training: TrainingLayout, source: str) -> tuple:
    """Parameters with equal keys have identical plans up to their name: every layer of one
    pipeline stage with the same suffix."""
    model = training.model
    if source.startswith("decoder.layers."):
        layer, suffix = source[len("decoder.layers."):].split(".", 1)
        return suffix, sharding.stage_of_layer(int(layer), model, training.pp)[0]
    return (source,)


# --------------------------------------------------------------------------------------------
# Building plans
# --------------------------------------------------------------------------------------------

def lacking_elements(training: TrainingLayout, rollout: RolloutLayout, rank: int) -> int:
    """Elements of ``rank``'s rollout shard (padding excluded) that its training shard lacks."""
    shapes = sharding.canonical_param_shapes(training.model)
    held = training.held(rank)
    lacking = 0
    for source, spec in rollout.wanted(rank).items():
        rows = spec.length - spec.padding - held_rows(held.get(source), spec)
        lacking += rows * math.prod(shapes[source]) // shapes[source][spec.dim]
    return lacking


def build_plan(training: TrainingLayout, rollout: RolloutLayout, dtype: torch.dtype,
               gpus_per_node: int = 8) -> ReshardPlan:
    """The plan moving every parameter from ``training`` to ``rollout``. Raises PlanError (the
    same on every rank) when the layouts do not fit together."""
    errors = training.errors()
    if rollout.engine not in ENGINES:
        errors.append(f"rollout engine {rollout.engine!r} must be one of {ENGINES}")
    colocated = rollout.first_rank == 0 and rollout.world_size == training.world_size
    if not colocated and rollout.first_rank != training.world_size:
        errors.append(f"the rollout layout covers {rollout.world_size} ranks from rank "
                      f"{rollout.first_rank} but the training layout covers "
                      f"{training.world_size}: the rollout ranks must be the training ranks "
                      "(colocated) or the ranks after them (split placement)")
    if rollout.model != training.model:
        errors.append("the rollout layout describes a different model than the training layout")
    if errors:
        raise PlanError("cannot reshard: " + "; ".join(errors))
    plan = ReshardPlan(training, rollout, dtype)
    cache: dict[tuple, ParamPlan] = {}
    for source in sharding.canonical_param_shapes(training.model):
        key = _geometry_key(training, source)
        if key not in cache:
            cache[key] = _plan_param(training, rollout, source, gpus_per_node)
        template = cache[key]
        plan.params.append(ParamPlan(source, template.full_shape, template.dim,
                                     template.transfers, template.local_copies))
    return plan


def lower_bound_received(training: TrainingLayout, rollout: RolloutLayout,
                         element_size: int) -> np.ndarray:
    """Bytes each rank must receive at least: its rollout shard's real rows it does not hold."""
    cache: dict[tuple, int] = {}
    lower = np.zeros(job_world_size(training, rollout), np.int64)
    for rank in rollout.ranks:
        holding = training.holding(rank) if rank < training.world_size else None
        key = (holding, rollout.shard_key(rank))
        if key not in cache:
            cache[key] = lacking_elements(training, rollout, rank)
        lower[rank] = cache[key]
    return lower * element_size

"""One rank's tensor of one parameter, as rows of the canonical full tensor.

Why this module exists
----------------------
Resharding is only cheap if it is exact about geometry: a rank may skip receiving a row only if
it provably holds that row already. So every layout describes a rank's tensor as a list of row
intervals of the *canonical* full tensor (mcore_rl.param_layout.sharding: Megatron names, TP=1,
unpadded vocab), concatenated along the parameter's split dimension, plus zero padding rows
(`ShardSpec`). Two layouts then compare by interval arithmetic alone, and the planner never
needs to know what "QKV" or "vocab padding" mean.

Every parameter is split along one dimension in every layout (dim 1 for row-parallel weights,
dim 0 otherwise); a replicated tensor is the single interval covering that dimension. This
module holds that description and Megatron's tensor-parallel cut (`megatron_pieces`);
vllm_shards.py holds vLLM's, layouts.py the layouts built from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from mcore_rl.config.model import ModelConfig
from mcore_rl.param_layout import sharding
from mcore_rl.param_layout.sharding import ShardKind

Interval = tuple[int, int]
"""[start, stop) along a parameter's split dimension, in canonical full coordinates."""


@dataclass(frozen=True)
class ShardSpec:
    """One rank's tensor of one parameter, described against the canonical full tensor."""

    name: str
    """The name the rank uses for the tensor (training local name or engine parameter name)."""

    source: str
    """Canonical full parameter it is cut from."""

    dim: int
    """Dimension along which the tensor is cut (the parameter's split dimension)."""

    pieces: tuple[Interval, ...]
    """Canonical intervals along ``dim``, concatenated in this order."""

    padding: int = 0
    """Zero rows appended along ``dim`` after the pieces (vocabulary padding)."""

    @property
    def length(self) -> int:
        """Extent of the tensor along ``dim``."""
        return sum(stop - start for start, stop in self.pieces) + self.padding

    def shape(self, full_shape: tuple) -> tuple:
        """Shape of this tensor given the canonical full shape."""
        shape = list(full_shape)
        shape[self.dim] = self.length
        return tuple(shape)

    def cut(self, full: torch.Tensor) -> torch.Tensor:
        """This tensor cut from the canonical full tensor ``full`` (a new contiguous tensor)."""
        parts = [full.narrow(self.dim, start, stop - start) for start, stop in self.pieces]
        if self.padding:
            shape = list(full.shape)
            shape[self.dim] = self.padding
            parts.append(full.new_zeros(shape))
        return torch.cat(parts, dim=self.dim).contiguous()

    def placed_pieces(self) -> Iterable[tuple[int, int, int]]:
        """(canonical start, canonical stop, offset in this tensor) per piece."""
        offset = 0
        for start, stop in self.pieces:
            yield start, stop, offset
            offset += stop - start


def split_dim(name: str) -> int:
    """The dimension parameter ``name`` is split along in every layout."""
    return 1 if sharding.shard_kind(name) is ShardKind.ROW else 0


def chunk(length: int, parts: int, index: int, base: int = 0) -> Interval:
    """Interval ``index`` of ``parts`` equal chunks of [base, base + length)."""
    size = length // parts
    return base + index * size, base + (index + 1) * size


def merge_adjacent(intervals: Iterable[Interval]) -> tuple[Interval, ...]:
    """Intervals with touching neighbours joined, order kept."""
    merged: list[list[int]] = []
    for start, stop in intervals:
        if merged and merged[-1][1] == start:
            merged[-1][1] = stop
        else:
            merged.append([start, stop])
    return tuple((start, stop) for start, stop in merged)


def vocab_pieces(vocab: int, padded: int, tp: int,
                  tp_rank: int) -> tuple[tuple[Interval, ...], int]:
    """(pieces, padding) of TP rank ``tp_rank`` when ``vocab`` rows are zero-padded to ``padded``
    and split evenly."""
    start, stop = chunk(padded, tp, tp_rank)
    real_stop = min(stop, vocab)
    pieces = ((start, real_stop),) if start < real_stop else ()
    return pieces, (stop - start) - max(0, real_stop - start)


def megatron_pieces(name: str, model: ModelConfig, tp: int,
                    tp_rank: int) -> tuple[tuple[Interval, ...], int]:
    """(pieces, padding) of Megatron TP rank ``tp_rank`` for canonical parameter ``name``: the
    same rows `sharding.split_for_tp` cuts."""
    kind = sharding.shard_kind(name)
    full = sharding.full_shape(name, model)
    length = full[split_dim(name)]
    if kind is ShardKind.REPLICATED:
        return ((0, length),), 0
    if kind is ShardKind.VOCAB:
        return vocab_pieces(model.vocab_size, model.padded_vocab_size(tp), tp, tp_rank)
    if kind is ShardKind.GATE_UP:
        half = length // 2
        return (chunk(half, tp, tp_rank), chunk(half, tp, tp_rank, base=half)), 0
    return (chunk(length, tp, tp_rank),), 0  # COLUMN, ROW, QKV


"""Tensor parallelism: one parameter's full tensor cut into TP shards, and the shards merged back.

Why this module exists
----------------------
Each `ShardKind` has one way to split and one inverse; conversion, resharding and checkpoint
merging all cut through here so that no two paths disagree on which rows a rank holds (the
layouts are described in `mcore_rl.param_layout.sharding`'s docstring). The checks on sizes,
ranks and shapes that every entry point of the package shares live here too.
"""

from __future__ import annotations

from typing import Sequence

import torch

from mcore_rl.config.model import ModelConfig
from mcore_rl.param_layout.rules import ShardKind, expert_of, full_shape, shard_kind


def _check_layout(model: ModelConfig, tp_size: int, pp_size: int = 1) -> None:
    """Raise ValueError if the model cannot be laid out at this TP/PP size."""
    if tp_size < 1 or pp_size < 1:
        raise ValueError(f"parallel sizes must be positive, got tp_size={tp_size}, "
                         f"pp_size={pp_size}")
    errors = model.check(tp_size, pp_size)
    if errors:
        raise ValueError("; ".join(errors))


def _check_rank(rank: int, size: int, what: str) -> None:
    """Raise ValueError unless 0 <= rank < size."""
    if not 0 <= rank < size:
        raise ValueError(f"{what}={rank} is outside [0, {size})")


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple, what: str) -> None:
    """Raise ValueError naming the tensor and both shapes if ``tensor`` is not ``expected``."""
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"{what} {name!r} has shape {tuple(tensor.shape)}, "
                         f"expected {tuple(expected)}")


def local_shape(name: str, model: ModelConfig, tp_size: int) -> tuple:
    """Shape of one TP rank's shard of parameter ``name`` (the same on every rank)."""
    shape = list(full_shape(name, model))
    kind = shard_kind(name)
    if kind is ShardKind.VOCAB:
        shape[0] = model.padded_vocab_size(tp_size) // tp_size
    elif kind in (ShardKind.COLUMN, ShardKind.GATE_UP, ShardKind.QKV):
        shape[0] //= tp_size
    elif kind is ShardKind.ROW:
        shape[1] //= tp_size
    return tuple(shape)


def _pad_vocab(full: torch.Tensor, model: ModelConfig, tp_size: int) -> torch.Tensor:
    """``full`` ([V, H]) followed by zero rows up to ``padded_vocab_size(tp_size)`` rows."""
    padding = model.padded_vocab_size(tp_size) - full.shape[0]
    return torch.cat([full, full.new_zeros((padding, *full.shape[1:]))], dim=0)


def _split_gate_up(full: torch.Tensor, tp_size: int, tp_rank: int) -> torch.Tensor:
    """Rank ``tp_rank``'s fused fc1 shard: cat([gate chunk, up chunk])."""
    gate, up = full.chunk(2, dim=0)
    return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]])


def _merge_gate_up(shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Inverse of `_split_gate_up`: all gate halves, then all up halves."""
    halves = [shard.chunk(2, dim=0) for shard in shards]
    return torch.cat([gate for gate, _ in halves] + [up for _, up in halves], dim=0)


def split_for_tp(name: str, full: torch.Tensor, model: ModelConfig, tp_size: int,
                 tp_rank: int) -> torch.Tensor:
    """Rank ``tp_rank``'s shard (contiguous) of the canonical full tensor ``full`` of parameter
    ``name``. Raises ValueError naming the parameter if ``full`` has the wrong shape."""
    _check_layout(model, tp_size)
    _check_rank(tp_rank, tp_size, "tp_rank")
    _check_shape(name, full, full_shape(name, model), "full tensor")
    return _split(shard_kind(name), full, tp_size, tp_rank, model)


def _split(kind: ShardKind, full: torch.Tensor, tp_size: int, tp_rank: int,
           model: ModelConfig | None = None) -> torch.Tensor:
    """Rank ``tp_rank``'s contiguous shard of ``full`` split as ``kind`` says (``model`` is
    needed for VOCAB only)."""
    if kind is ShardKind.REPLICATED:
        shard = full
    elif kind is ShardKind.ROW:
        shard = full.chunk(tp_size, dim=1)[tp_rank]
    elif kind is ShardKind.VOCAB:
        shard = _pad_vocab(full, model, tp_size).chunk(tp_size, dim=0)[tp_rank]
    elif kind is ShardKind.GATE_UP:
        shard = _split_gate_up(full, tp_size, tp_rank)
    else:  # COLUMN and QKV
        shard = full.chunk(tp_size, dim=0)[tp_rank]
    return shard.contiguous()


def merge_from_tp(name: str, shards: Sequence[torch.Tensor], model: ModelConfig, tp_size: int,
                  check_replicas: bool = False) -> torch.Tensor:
    """The canonical full tensor of parameter ``name`` from its ``tp_size`` shards (in TP rank
    order). With ``check_replicas``, replicated tensors (norms) must agree across ranks. Raises
    ValueError naming the parameter on a wrong shard count or shape."""
    _check_layout(model, tp_size)
    if len(shards) != tp_size:
        raise ValueError(f"{name!r}: got {len(shards)} shards for tp_size={tp_size}")
    expected = local_shape(name, model, tp_size)
    for rank, shard in enumerate(shards):
        _check_shape(name, shard, expected, f"TP rank {rank} shard of")
    kind = shard_kind(name)
    if kind is ShardKind.REPLICATED and check_replicas:
        for rank, shard in enumerate(shards[1:], start=1):
            if not torch.equal(shard, shards[0]):
                raise ValueError(f"replicated {name!r} differs between TP rank 0 and {rank}")
    return _merge(kind, shards, model)


def _merge(kind: ShardKind, shards: Sequence[torch.Tensor],
           model: ModelConfig | None = None) -> torch.Tensor:
    """Inverse of `_split`: the full tensor from its shards in TP rank order."""
    if kind is ShardKind.REPLICATED:
        full = shards[0]
    elif kind is ShardKind.ROW:
        full = torch.cat(list(shards), dim=1)
    elif kind is ShardKind.VOCAB:
        full = torch.cat(list(shards), dim=0)[: model.vocab_size]
    elif kind is ShardKind.GATE_UP:
        full = _merge_gate_up(shards)
    else:  # COLUMN and QKV
        full = torch.cat(list(shards), dim=0)
    return full.contiguous()



def tensor_split(name: str, tp: tuple[int, int], etp: tuple[int, int] | None) -> tuple[int, int]:
    """(size, rank) of the tensor-parallel split that parameter ``name`` is cut by, given the
    rank's (size, rank) in TP and in expert TP (None: the same as TP). An expert's matrices are
    split over the expert tensor-parallel ranks (Megatron ETP); every other tensor, the shared
    expert's included, over TP."""
    return etp if etp is not None and expert_of(name) is not None else tp

"""Model weights as Megatron-Core ShardedTensors in a layout-independent checkpoint.

Why not `GPTModel.sharded_state_dict()`: Megatron's own keys embed the vocabulary padded for the
TP size that saved it, so a checkpoint written at TP=2 does not load at TP=4 whenever the padding
differs, and the converters (which build shards straight from HF tensors, without a model) would
need a model to describe them. Here every parameter is stored under its canonical full name
(parallel/sharding.py) with its canonical global shape; the only padding kept is the vocabulary
rounded up to `make_vocab_size_divisible_by` rows, which no TP size changes. Each rank describes
its own slice, so the same function serves a trained model, a converter and a loader:

An expert's matrices are cut by the expert tensor-parallel split (ETP size and rank) instead of
TP's, so a checkpoint written at one ETP loads at another like one written at another TP.

- column-parallel and fused QKV: chunk `tp_rank` of `tp` along rows;
- row-parallel: chunk `tp_rank` of `tp` along columns;
- fused gate/up: two pieces, rows `tp_rank` and `tp + tp_rank` of `2 * tp` chunks;
- vocabulary: equal blocks of rows (the gcd of a rank's rows and the stored rows); blocks that
  lie wholly in TP padding are not stored and load as zeros;
- replicated: stored once (replica 0), every other rank is a replica.
Data-parallel copies are replicas too, and so is the tied output-layer copy on the last pipeline
stage: it is described as the embedding, so it is not stored twice and loads from it.
"""

from __future__ import annotations

import math

import torch

from ..config import ModelConfig
from ..param_layout import sharding
from ..runtime.model_rank import ModelRank

StateItems = dict[str, object]


def stored_vocab_rows(model: ModelConfig) -> int:
    """Rows of the vocabulary tensors in a checkpoint: vocab_size rounded up to
    make_vocab_size_divisible_by (independent of TP)."""
    block = model.make_vocab_size_divisible_by
    return -(-model.vocab_size // block) * block


def stored_shape(name: str, model: ModelConfig) -> tuple:
    """Global shape of a canonical parameter in a checkpoint."""
    shape = sharding.full_shape(name, model)
    if sharding.shard_kind(name) is sharding.ShardKind.VOCAB:
        return (stored_vocab_rows(model), *shape[1:])
    return shape


def _vocab_blocks(key: str, shard: torch.Tensor, model: ModelConfig, tp_rank: int,
                  replica: tuple) -> list:
    from megatron.core.dist_checkpointing import ShardedTensor

    stored = stored_vocab_rows(model)
    rows_per_rank = shard.shape[0]
    block = math.gcd(rows_per_rank, stored)
    first = tp_rank * rows_per_rank // block
    pieces = []
    for local_block in range(rows_per_rank // block):
        global_block = first + local_block
        if global_block * block >= stored:
            break
        data = shard.narrow(0, local_block * block, block)
        pieces.append(ShardedTensor.from_rank_offsets(
            key, data, (0, global_block, stored // block), replica_id=replica))
    return pieces


def sharded_pieces(name: str, shard: torch.Tensor, model: ModelConfig, tp_size: int,
                   tp_rank: int, replica: tuple = (0,)) -> list:
    """The ShardedTensors describing TP rank `tp_rank`'s shard of canonical parameter `name`.
    `replica` is all zeros for the one copy that is written (e.g. (dp_rank,) otherwise). The
    pieces' data are views of `shard`, so loading into them fills `shard`."""
    from megatron.core.dist_checkpointing import ShardedTensor

    kind = sharding.shard_kind(name)
    if kind is sharding.ShardKind.REPLICATED:
        return [ShardedTensor.from_rank_offsets(name, shard, replica_id=(*replica, tp_rank))]
    if kind in (sharding.ShardKind.COLUMN, sharding.ShardKind.QKV):
        return [ShardedTensor.from_rank_offsets(name, shard, (0, tp_rank, tp_size),
                                                replica_id=replica)]
    if kind is sharding.ShardKind.ROW:
        return [ShardedTensor.from_rank_offsets(name, shard, (1, tp_rank, tp_size),
                                                replica_id=replica)]
    if kind is sharding.ShardKind.GATE_UP:
        gate, up = shard.chunk(2, dim=0)
        return [ShardedTensor.from_rank_offsets(name, gate, (0, tp_rank, 2 * tp_size),
                                                replica_id=replica),
                ShardedTensor.from_rank_offsets(name, up, (0, tp_size + tp_rank, 2 * tp_size),
                                                replica_id=replica)]
    return _vocab_blocks(name, shard, model, tp_rank, replica)


def split_of(place: ModelRank, name: str) -> tuple[int, int]:
    """(size, rank) of the tensor-parallel split canonical parameter ``name`` is cut by at
    ``place`` (`sharding.tensor_split`: experts by the expert TP, the rest by TP)."""
    return sharding.tensor_split(name, (place.tp_size, place.tp_rank),
                                 (place.etp_size, place.etp_rank))


def stage_params_of(place: ModelRank, model: ModelConfig, head: str = "lm") -> dict[str, str]:
    """`sharding.stage_params` of the stage at ``place``: local names -> canonical names."""
    return sharding.stage_params(model, place.pp_size, place.pp_rank, head, place.ep_size,
                                 place.ep_rank)


def sharded_state_dict(local_shards: dict, model: ModelConfig, place: ModelRank,
                       head: str = "lm") -> StateItems:
    """{unique key: ShardedTensor} for one rank's local shards (local names, as
    `sharding.shard_full_state` or a model stage hold them) at `place`. An expert's copies are
    its expert data-parallel ranks."""
    sources = stage_params_of(place, model, head)
    if set(local_shards) != set(sources):
        raise ValueError(f"local shards {sorted(set(local_shards) ^ set(sources))} do not match "
                         f"pipeline stage {place.pp_rank}'s parameters")
    items = {}
    tied_copy = sharding.has_tied_output_copy(model, place.pp_size, place.pp_rank, head)
    for local, canonical in sources.items():
        is_copy = int(tied_copy and local == sharding.OUTPUT_LAYER)
        copy = place.edp_rank if sharding.expert_of(canonical) is not None else place.dp_rank
        pieces = sharded_pieces(canonical, local_shards[local], model,
                                *split_of(place, canonical), (is_copy, copy))
        for index, piece in enumerate(pieces):
            items[f"{local}#{index}"] = piece
    return items


def full_tensor_request(name: str, model: ModelConfig) -> StateItems:
    """A request to load the whole stored tensor of `name` (for export); the result must be
    cut back to `sharding.full_shape` (vocabulary rows beyond vocab_size are padding)."""
    from megatron.core.dist_checkpointing import ShardedTensor

    data = torch.empty(stored_shape(name, model), dtype=torch.float32)
    return {name: ShardedTensor.from_rank_offsets(name, data, replica_id=0)}

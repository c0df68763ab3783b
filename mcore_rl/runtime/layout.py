"""Where a rank sits in a model's parallel layout: its dense and its expert coordinates.

Why this module exists
----------------------
Megatron-Core lays two grids over the same ranks (``initialize_model_parallel``): the dense grid
TP x CP x DP x PP for attention and dense layers, and the expert grid ETP x EP x EDP x PP for MoE
experts, both read through one rank order. When the expert tensor-parallel size equals TP, an
expert rank is simply the data-parallel rank modulo EP; at ETP != TP (the common Qwen3-30B-A3B
recipe: attention at TP2-4, experts at ETP1 x EP8) the expert grid cuts across the TP groups,
and every part that cuts expert shards (conversion, checkpoints, resharding) must find a rank's
expert coordinates exactly as Megatron's ``RankGenerator`` does. This is the one place they are
computed: `ParallelLayout` is pure (no torch.distributed, no Megatron), so the planner and the
converters use it without a live world and tests compare it with Megatron's own rank groups.

A rank's place in a layout with its process groups is a `ModelRank` (runtime/model_rank.py);
the trained models' groups are Megatron's global state, created and read back once in
runtime/training_groups.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config.parallel import ParallelConfig, expert_grid_errors

@dataclass(frozen=True)
class RankPosition:
    """One rank's coordinates in both grids of a `ParallelLayout`."""

    tp_rank: int
    pp_rank: int
    dp_rank: int
    cp_rank: int
    ep_rank: int
    """Which experts the rank holds (block ep_rank of EP equal blocks)."""

    etp_rank: int
    """Which tensor-parallel slice of its experts the rank holds."""

    edp_rank: int
    """Which copy of its expert shards the rank holds (Megatron's expert data-parallel rank)."""


@dataclass(frozen=True)
class ParallelLayout:
    """One model's sizes over ``world_size`` ranks, in Megatron's rank order."""

    tp: int
    pp: int
    dp: int
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    """Expert tensor-parallel size; None: the TP size."""

    order: str = "tp-cp-ep-dp-pp"
    """Megatron's ``order``: dimension names, fastest-varying over consecutive ranks first. A
    dimension it leaves out must have size 1 (cp and ep may be omitted at size 1)."""

    @classmethod
    def of(cls, parallel: ParallelConfig, world_size: int) -> "ParallelLayout":
        """The layout `parallel` describes over ``world_size`` ranks."""
        return cls(parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                   parallel.data_parallel_size(world_size), parallel.context_parallel_size,
                   parallel.expert_model_parallel_size, parallel.expert_tensor_parallel_size,
                   parallel.megatron_order())

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def expert_dp(self) -> int:
        """Copies of each expert shard: the ranks of a stage over ETP x EP."""
        return self.tp * self.cp * self.dp // (self.expert_tp * self.ep)

    def errors(self) -> list[str]:
        """Broken rules of the expert grid (empty when valid; config.parallel owns them)."""
        return expert_grid_errors(self.ep, self.expert_tp, self.tp * self.cp * self.dp)

    def position(self, rank: int) -> RankPosition:
        """``rank``'s coordinates in the dense and the expert grid."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the layout's {self.world_size} ranks")
        dense = _coordinates(rank, self.order, self._dense_sizes())
        expert = _coordinates(rank, self.order, self._expert_sizes())
        return RankPosition(dense["tp"], dense["pp"], dense["dp"], dense["cp"], expert["ep"],
                            expert["tp"], expert["dp"])

    def replica_rank(self, position: RankPosition) -> int:
        """Which copy of the dense weights ``position`` holds: its rank among the data x context
        parallel ranks, numbered as Megatron's DP x CP group (the faster of the two first)."""
        names = self.order.split("-")
        if "cp" in names and "dp" in names and names.index("dp") < names.index("cp"):
            return position.cp_rank * self.dp + position.dp_rank
        return position.dp_rank * self.cp + position.cp_rank

    def rank_of(self, tp_rank: int, pp_rank: int, dp_rank: int, cp_rank: int = 0) -> int:
        """The rank at these dense-grid coordinates (inverse of `position`'s dense part)."""
        return _rank_at(self.order, self._dense_sizes(),
                        {"tp": tp_rank, "cp": cp_rank, "dp": dp_rank, "pp": pp_rank, "ep": 0})

    def expert_rank(self, pp_rank: int, ep_rank: int, etp_rank: int, edp_rank: int) -> int:
        """The rank at these expert-grid coordinates (inverse of `position`'s expert part)."""
        return _rank_at(self.order, self._expert_sizes(),
                        {"tp": etp_rank, "ep": ep_rank, "dp": edp_rank, "pp": pp_rank, "cp": 0})

    def _dense_sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp, "ep": 1}

    def _expert_sizes(self) -> dict[str, int]:
        return {"tp": self.expert_tp, "ep": self.ep, "dp": self.expert_dp, "pp": self.pp, "cp": 1}


def _rank_at(order: str, sizes: dict[str, int], coordinates: dict[str, int]) -> int:
    """The rank at ``coordinates`` over ``sizes`` in ``order`` (inverse of `_coordinates`)."""
    rank, stride = 0, 1
    for name in order.split("-"):
        rank += coordinates[name] * stride
        stride *= sizes[name]
    return rank


def _coordinates(rank: int, order: str, sizes: dict[str, int]) -> dict[str, int]:
    """``rank`` decomposed over ``sizes`` in ``order``, fastest first (as Megatron's
    RankGenerator numbers its groups)."""
    names = order.split("-")
    missing = [name for name, size in sizes.items() if size > 1 and name not in names]
    if missing:
        raise ValueError(f"rank order {order!r} has no {missing} dimension of size > 1")
    found = {name: 0 for name in sizes}
    for name in names:
        rank, found[name] = divmod(rank, sizes[name])
    return found

"""The weight sync: the actor's training shards into the rollout engine, through the resharder.

It measures every sync on every rank (bytes received, seconds, peak extra memory) and knows
the plan's lower bound for this rank, so the step's metrics show, max over ranks, that each
rank received exactly what its rollout shard lacks and what that cost:

    reshard/bytes_received_max    reshard/lower_bound_bytes    reshard/syncs (0 or 1 a step)
    reshard/delta_share           (bytes received / lower bound: 1 for a whole sync, the
                                   delta's share with rollout.delta_sync)
    memory/reshard_peak_extra_mb  (and the sync's seconds as the step phase time/reshard)

An evaluation's syncs are left out of them (`PolicyGenerator.uncounted`).

Seconds and memory sit under time/ and memory/ with the other figures a rerun does not repeat.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from mcore_rl.resharding import Resharder
from mcore_rl.resharding.plan import lower_bound_received
from mcore_rl.rollout import RolloutEngine
from mcore_rl.runtime.memory import PeakMemory

from mcore_rl.observability.step_metrics import SumsAndCounts


@dataclass(frozen=True)
class SyncFigures:
    """One sync on one rank."""

    bytes_received: int
    seconds: float
    peak_extra_mb: float
    """Memory above the level before the sync, at its peak (device memory on GPUs)."""
    delta_share: float
    """Bytes received over the rank's lower bound (0 where the lower bound is 0)."""

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([self.bytes_received, self.seconds, self.peak_extra_mb,
                             self.delta_share], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, values: torch.Tensor) -> "SyncFigures":
        return cls(*values.tolist())


class WeightSync:
    """Streams `Resharder.sync` into `engine.update_weights` and keeps its figures."""

    def __init__(self, resharder: Resharder, engine: RolloutEngine):
        self.resharder = resharder
        self.engine = engine
        plan = resharder.plan
        self.lower_bound_bytes = int(lower_bound_received(
            plan.training, plan.rollout, plan.element_size)[resharder.rank])
        """Bytes this rank must receive per sync: its rollout shard's rows it does not hold."""
        self.since_last_step: list[SyncFigures] = []
        """This rank's syncs since `add_metrics` last ran."""

    def sync(self, local_parameters: dict[str, torch.Tensor]) -> SyncFigures:
        """Collective: every rank's engine receives its shards of these training tensors."""
        started = time.perf_counter()
        with PeakMemory() as peak:
            self.engine.update_weights(self.resharder.sync(local_parameters))
        received = self.resharder.received_bytes
        figures = SyncFigures(received, time.perf_counter() - started, peak.extra_bytes / 2 ** 20,
                              received / self.lower_bound_bytes if self.lower_bound_bytes else 0.0)
        self.since_last_step.append(figures)
        return figures

    def add_metrics(self, stats: SumsAndCounts) -> None:
        """The figures of the syncs since the last call, for the step's statistics to reduce
        (maxima over ranks)."""
        add_sync_metrics(stats, self.since_last_step, self.lower_bound_bytes)
        self.since_last_step = []


def add_sync_metrics(stats: SumsAndCounts, syncs: list[SyncFigures], lower_bound_bytes: int
                     ) -> None:
    """The largest figures of `syncs` (zeros when there was none) and the lower bound."""
    maxima = {"reshard/bytes_received_max": max((s.bytes_received for s in syncs), default=0),
              "reshard/delta_share": max((s.delta_share for s in syncs), default=0.0),
              "memory/reshard_peak_extra_mb": max((s.peak_extra_mb for s in syncs), default=0.0),
              "reshard/syncs": len(syncs),
              "reshard/lower_bound_bytes": lower_bound_bytes}
    for name, value in maxima.items():
        stats.add_max(name, torch.tensor([float(value)]))

"""Which ranks of the job train and which generate.

Colocated (the default): every rank trains and generates, phase by phase, and the rollout engine
sleeps while the roles train. Split: the last `rollout_ranks` ranks run only the rollout engine,
the others only train, and the two sides run at the same time (generation of the next batches
overlaps training on the current one, within rollout.max_staleness). Every rank still runs the
same program; its side follows from its rank and this section.
"""

from __future__ import annotations

from dataclasses import dataclass

SIDES = ("trainer", "rollout")


@dataclass(frozen=True)
class PlacementConfig:
    """Colocated or split placement of the RL job's ranks."""

    rollout_ranks: int = 0
    """0: colocated (every rank trains and generates). N > 0: split placement, the last N ranks
    of the world run the rollout engine (vLLM at rollout.rollout_tp over those N ranks) and the
    first world - N ranks train (parallel.* over them); weights go from the trainers to the
    rollout ranks through the resharder after every update."""

    @property
    def split(self) -> bool:
        return self.rollout_ranks > 0

    def trainer_ranks(self, world_size: int) -> int:
        """Ranks that train (the whole world when colocated)."""
        return world_size - self.rollout_ranks

    def engine_ranks(self, world_size: int) -> int:
        """Ranks the rollout engine spans (the whole world when colocated)."""
        return self.rollout_ranks or world_size

    def side_of(self, rank: int, world_size: int) -> str:
        """"trainer" or "rollout" for job rank `rank` in split placement."""
        return SIDES[rank >= self.trainer_ranks(world_size)]

    def errors(self, world_size: int) -> list[str]:
        """Broken rules, each naming its field (empty when valid)."""
        if self.rollout_ranks < 0 or (self.rollout_ranks and self.rollout_ranks >= world_size):
            return [f"placement.rollout_ranks={self.rollout_ranks} must be 0 (colocated) or "
                    f"leave at least one of the world's {world_size} ranks to train"]
        return []

"""Which prompts each data-parallel rank takes at every step, resumable exactly.

Every rank computes the same global order (a seeded permutation per epoch) and takes its own
contiguous slice of each step's prompts, so no rank talks to another and the union over ranks is
each step's prompts exactly once. The position (epoch, offset into the epoch's order) is all the
state there is; it is the same on every rank, so any rank's state_dict resumes the whole job,
also at another DP size.

Like verl's dataloader (drop_last), an epoch's tail that cannot fill a whole step is dropped:
the next step starts the next epoch, with a fresh permutation. Within an epoch no prompt
repeats.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .records import DataError


class PromptSampler:
    """Prompt indices per step for one data-parallel rank."""

    def __init__(self, num_records: int, prompts_per_step: int, dp_rank: int, dp_size: int,
                 seed: int, shuffle: bool = True):
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        if prompts_per_step < 1 or prompts_per_step % dp_size:
            raise DataError(f"prompts per step ({prompts_per_step}) must be a positive multiple "
                            f"of the data-parallel size ({dp_size})")
        if num_records < prompts_per_step:
            raise DataError(f"the dataset has {num_records} prompts (after dropping bad and "
                            f"overlong ones), fewer than the {prompts_per_step} one step needs")
        self.num_records = num_records
        self.prompts_per_step = prompts_per_step
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.shuffle = seed, shuffle
        self.epoch, self.offset = 0, 0
        self._order = self._epoch_order(0)

    @property
    def steps_per_epoch(self) -> int:
        """Whole steps in one pass over the data (the tail is dropped)."""
        return self.num_records // self.prompts_per_step

    def next_indices(self) -> list[int]:
        """This rank's prompt indices for the next step (prompts_per_step // dp_size of them)."""
        if self.offset + self.prompts_per_step > self.num_records:
            self._start_epoch(self.epoch + 1)
        per_rank = self.prompts_per_step // self.dp_size
        start = self.offset + self.dp_rank * per_rank
        self.offset += self.prompts_per_step
        return self._order[start:start + per_rank].tolist()

    def state_dict(self) -> dict[str, Any]:
        """The position, plus what it is only valid for (identical on every rank)."""
        return {"epoch": self.epoch, "offset": self.offset, "num_records": self.num_records,
                "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; refuses a state from another dataset or seed, whose
        order would differ (prompts_per_step and the DP size may change)."""
        for key in ("num_records", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise DataError(f"sampler state was saved with {key}={state[key]!r}, this run "
                                f"has {getattr(self, key)!r}; the prompt order would differ")
        if not 0 <= state["offset"] <= self.num_records or state["epoch"] < 0:
            raise DataError(f"sampler state has an impossible position: epoch {state['epoch']}, "
                            f"offset {state['offset']} of {self.num_records}")
        self._start_epoch(int(state["epoch"]))
        self.offset = int(state["offset"])

    def _start_epoch(self, epoch: int) -> None:
        self.epoch, self.offset = epoch, 0
        self._order = self._epoch_order(epoch)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        """The global order of `epoch`: a permutation seeded by (seed, epoch), or 0..n-1."""
        if not self.shuffle:
            return np.arange(self.num_records)
        return np.random.default_rng([self.seed % 2**64, epoch]).permutation(self.num_records)

"""The order in which jobs on a fixed dataset (sft, rm, dpo) visit their examples.

Every rank computes the same seeded permutation per epoch and takes its own contiguous share of
each step's examples, so no rank talks to another and the union over ranks is the step's
examples exactly once.
"""

from __future__ import annotations

import numpy as np


def epoch_order(count: int, seed: int, epoch: int) -> list[int]:
    """The seeded order of the examples in `epoch` (identical on every rank)."""
    return np.random.default_rng([seed, epoch]).permutation(count).tolist()


def rank_rows(order: list[int], step: int, batch_size: int, dp_rank: int,
              dp_size: int) -> list[int]:
    """This data-parallel rank's share of the step's `batch_size` examples."""
    step_rows = order[step * batch_size:(step + 1) * batch_size]
    per_rank = batch_size // dp_size
    return step_rows[dp_rank * per_rank:(dp_rank + 1) * per_rank]

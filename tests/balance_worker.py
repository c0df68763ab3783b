"""What one rank of the balancing world does (run by tests/test_balance.py).

Every rank builds its rows from a generator seeded by its rank (`make_batch`), so the test can
rebuild all ranks' rows and check each rank's result. Each rank saves what it got to
`{out}/rank{r}.pt`; the assertions are in the test.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from mcore_rl.training.balance import balance_over_data_parallel, exchange_rows

ROWS = 5
PAD_ID = 7  # input_ids arrive padded with 7; the balanced batch is zero past every length


def row_lengths(rank: int) -> list[int]:
    """Deliberately unbalanced: rank 0 long rows, rank 1 short ones, rank 2 mixed (one empty)."""
    generator = torch.Generator().manual_seed(1000 + rank)
    low, high = [(20, 41), (1, 7), (0, 31)][rank]
    lengths = torch.randint(low, high, (ROWS,), generator=generator).tolist()
    if rank == 2:
        lengths[1] = 0
    return lengths


def make_batch(rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s rows, padded to its own width (longest row + rank-dependent extra)."""
    lengths = row_lengths(rank)
    width = max(lengths) + [0, 3, 5][rank]
    generator = torch.Generator().manual_seed(2000 + rank)
    valid = torch.arange(width) < torch.tensor(lengths).unsqueeze(1)
    ids = torch.randint(10, 100, (ROWS, width), generator=generator)
    noise = torch.randn(ROWS, width, generator=generator)
    return {
        "input_ids": torch.where(valid, ids, torch.full_like(ids, PAD_ID)),
        "attention_mask": valid.long(),
        "loss_mask": valid & (torch.arange(width) >= 2),
        "old_logprobs": torch.where(valid, -noise.abs(), torch.zeros_like(noise)),
        "returns": (noise * valid).to(torch.bfloat16),
        "pair": torch.stack([noise, noise + 1], dim=2).double() * valid.unsqueeze(2),
        "scores": torch.randn(ROWS, generator=generator),
        "group_ids": torch.arange(ROWS) + 100 * rank,
        "truncated": torch.tensor([row % 2 == rank % 2 for row in range(ROWS)]),
        "extra": torch.randint(0, 9, (ROWS, 3), generator=generator, dtype=torch.int32),
    }


def scrambled_assignment(ranks: int) -> list[list[tuple[int, int]]]:
    """A fixed assignment where most rows move, in an unusual order within destinations."""
    generator = torch.Generator().manual_seed(7)
    everything = [(rank, row) for rank in range(ranks) for row in range(ROWS)]
    order = torch.randperm(len(everything), generator=generator).tolist()
    shuffled = [everything[index] for index in order]
    return [shuffled[dest * ROWS:(dest + 1) * ROWS] for dest in range(ranks)]


def run(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    batch = make_batch(rank)
    results = {}
    results["balanced"], results["stats"] = balance_over_data_parallel(batch, None)
    results["scrambled"] = exchange_rows(batch, scrambled_assignment(3), None)
    outer = dist.new_group([0, 2])  # a DP group that is not the world: global rank 2 is its 1
    if rank in (0, 2):
        results["subgroup"], results["subgroup_stats"] = balance_over_data_parallel(batch, outer)
    mismatched = dict(batch)
    if rank == 1:
        mismatched["scores"] = mismatched["scores"].double()
    try:
        balance_over_data_parallel(mismatched, None)
        results["mismatch_error"] = None
    except ValueError as error:
        results["mismatch_error"] = str(error)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()

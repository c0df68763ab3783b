"""Fail together: turn one rank's problem into the same exception on every rank of a group.

A rank that raises alone leaves its peers blocked in the next collective until the timeout. Code
that checks inputs or starts an engine therefore collects its problems as strings, calls
`raise_on_any_rank`, and either every rank continues or every rank raises the same message,
naming the ranks that found each problem. The exception carries `raised_on_every_rank = True`,
so one rank can report it for all.
"""

from __future__ import annotations

import torch.distributed as dist


def raise_on_any_rank(problems: list[str], error_type: type[Exception], prefix: str,
                      group=None) -> None:
    """All-gather each rank's problems over `group` (the world when None); raise
    error_type(prefix + every rank's problems) on all ranks if any rank has one."""
    if not dist.is_initialized():
        everyone, ranks = [problems], [0]
    else:
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, list(problems), group=group)
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    raise_gathered(dict(zip(ranks, everyone)), error_type, prefix)


def raise_gathered(problems_by_rank: dict[int, list[str]], error_type: type[Exception],
                   prefix: str) -> None:
    """Raise error_type(prefix + every rank's problems), marked as raised on every rank, if
    any rank has one; every rank must call it with the same gathered problems."""
    messages = [f"rank {rank}: {problem}" for rank, problems in problems_by_rank.items()
                for problem in problems]
    if messages:
        error = error_type(prefix + "; ".join(messages))
        error.raised_on_every_rank = True
        raise error

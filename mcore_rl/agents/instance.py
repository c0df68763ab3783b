"""Episodes on an engine instance that spans several ranks (rollout TP > 1).

Every rank of such an instance must add the same requests at the same engine steps, but what an
environment answers, and when, differs from process to process (tools are not deterministic,
their timing never is). So one rank runs the episodes of the whole instance: the group's first
rank gathers every rank's prompts (ranks with the same data shard bring the same prompts, which
run once), runs the episodes against a stand-in engine that tells the other ranks, before each
step, which requests to add and whether to go on; the others only mirror the engine calls. At
the end each rank takes its own shard's completions back.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from mcore_rl.config.rollout import SamplingConfig
from mcore_rl.rollout import Generation, RolloutEngine, prefill_counts
from mcore_rl.runtime.regroup import gather_shares, one_share_per_key


def run_on_instance(runner, engine: RolloutEngine, records: list, sampling: SamplingConfig,
                    max_prompt_tokens: int) -> Generation:
    """`runner.run(...)` for this rank's records, wherever the instance's episodes run."""
    group = engine.instance_group
    if group is None or dist.get_world_size(group) == 1:
        return runner.run(engine, records, sampling, max_prompt_tokens)
    leader = dist.get_process_group_ranks(group)[0]
    by_shard = one_share_per_key(gather_shares(engine.shard_key, records, group))
    payload = [None]
    if dist.get_rank() == leader:
        pooled = [record for share in by_shard.values() for record in share]
        try:
            generation = runner.run(_LeadingEngine(engine, group, leader), pooled, sampling,
                                    max_prompt_tokens)
        except Exception as error:  # the other ranks raise it too instead of waiting
            _tell(group, leader, f"{type(error).__name__}: {error}")
            raise
        _tell(group, leader, None)
        payload = [_split(generation, {key: len(share) for key, share in by_shard.items()})]
    else:
        _mirror(engine, group, leader)
    dist.broadcast_object_list(payload, src=leader, group=group)
    return payload[0][engine.shard_key]


class _LeadingEngine:
    """The instance's engine as the leading rank drives it: the requests added since the last
    check go to every rank of the instance with the check itself."""

    def __init__(self, engine: RolloutEngine, group, leader: int):
        self.engine, self.group, self.leader = engine, group, leader
        self.pending = []

    def add_requests(self, requests) -> None:
        self.pending += requests

    def has_unfinished(self, local_work: bool = False) -> bool:
        _tell(self.group, self.leader, (self.pending, local_work))
        if self.pending:
            self.engine.add_requests(self.pending)
            self.pending = []
        return self.engine.has_unfinished(local_work)

    def step(self):
        return self.engine.step()


def _tell(group, leader: int, message) -> None:
    """From the leader to the instance's other ranks: the next (requests, local_work), None
    (the episodes ended) or an error's text."""
    dist.broadcast_object_list([message], src=leader, group=group)


def _mirror(engine: RolloutEngine, group, leader: int) -> None:
    """The other ranks' engine calls, as the leader makes them, until it says the end."""
    while True:
        message = [None]
        dist.broadcast_object_list(message, src=leader, group=group)
        if message[0] is None:
            return
        if isinstance(message[0], str):
            raise RuntimeError(f"rank {leader}, which runs this engine instance's episodes, "
                               f"failed: {message[0]}")
        requests, local_work = message[0]
        if requests:
            engine.add_requests(requests)
        if engine.has_unfinished(local_work):
            engine.step()


def _split(generation: Generation, counts: dict[int, int]) -> dict[int, Generation]:
    """The pooled generation cut back into each shard's (prompts in pooled order)."""
    parts, start = {}, 0
    for key, count in counts.items():
        completions = [dataclasses.replace(c, prompt_index=c.prompt_index - start)
                       for c in generation.completions if start <= c.prompt_index < start + count]
        parts[key] = Generation(completions, generation.prompts[start:start + count],
                                {**generation.metrics, **prefill_counts(completions)})
        start += count
    return parts

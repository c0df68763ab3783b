"""Generate a data shard's prompts once, however many engine instances its ranks hold.

Every rank of a data shard's group (TP x CP x PP) trains on the same rows, but an engine
instance is a group of `rollout_tp` consecutive ranks (vLLM) or one model-parallel group (the
Megatron engine). Where the shard's ranks hold several instances (rollout_tp below TP x CP,
context parallelism, pipeline stages), each used to generate the whole shard and all copies
but one were dropped: CP2 at rollout_tp=1 generated twice, and called the tools and APIs of
agents twice. Instead the instances split the shard's prompts in contiguous parts, each
generates its part, and the parts are joined on every rank of the shard (runtime/regroup.py's
gather; completions are Python objects). Instances are told apart by their first rank, learnt once.
Random draws follow a prompt's position in the shard (`RolloutEngine.generate`'s
first_position), so a part samples what generating the whole shard would have.

With fewer prompts than instances nothing is split (an instance with no prompt would leave
vLLM's data-parallel instances waiting for it): every instance generates them all and the
first instance's result is used, as before.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from mcore_rl.rollout import Completion, Generation, RolloutEngine, prefill_counts
from mcore_rl.runtime.regroup import gather_ints, gather_shares, one_share_per_key


class ShardParts:
    """Which part of the shard's prompts this rank's engine instance generates, and the join."""

    def __init__(self, engine: RolloutEngine, shard_group):
        """Collective over `shard_group` (once, when the trainer is built)."""
        group = engine.instance_group
        instance = dist.get_process_group_ranks(group)[0] if group is not None \
            else dist.get_rank()
        self.group = shard_group
        instances = list(dict.fromkeys(gather_ints(instance, shard_group)))
        self.count = len(instances)
        """Engine instances among the shard's ranks."""
        self.index = instances.index(instance)
        """This rank's instance among them (the part it generates)."""

    def splits(self, items: list) -> bool:
        """Whether `items` (the shard's prompts) are generated in parts."""
        return 1 < self.count <= len(items)

    def mine(self, items: list) -> tuple[int, list]:
        """(position of its first, this instance's part of `items`): all of them when not
        split."""
        if not self.splits(items):
            return 0, items
        start, stop = _bounds(len(items), self.count, self.index)
        return start, items[start:stop]

    def joined(self, part: Generation, total: int) -> Generation:
        """The whole shard's generation from each instance's `part` of `total` prompts (or,
        not split, the first instance's), the same on every rank of the shard (collective
        where the shard's ranks hold several instances)."""
        if self.count == 1:  # one instance: its ranks already hold the same generation
            return part
        # An instance's ranks hold the same part: each counts once.
        by_index = dict(sorted(one_share_per_key(
            gather_shares(self.index, part, self.group)).items()))
        if not self.splits(range(total)):
            return by_index[0]
        completions: list[Completion] = []
        prompts: list[list[int]] = []
        for index, generation in by_index.items():
            start, _ = _bounds(total, self.count, index)
            completions += [dataclasses.replace(c, prompt_index=c.prompt_index + start)
                            for c in generation.completions]
            prompts += generation.prompts
        return Generation(completions, prompts, _joined_metrics(list(by_index.values()),
                                                               completions))


def _bounds(total: int, count: int, index: int) -> tuple[int, int]:
    """[start, stop) of part `index` of `count` near-equal contiguous parts of `total`."""
    return total * index // count, total * (index + 1) // count


def _joined_metrics(generations: list[Generation], completions: list[Completion]) -> dict:
    """Counts add up; time is the slowest part's (they ran side by side)."""
    metrics = {}
    for generation in generations:
        for name, value in generation.metrics.items():
            if name == "seconds":
                metrics[name] = max(metrics.get(name, 0.0), value)
            elif isinstance(value, (int, float)):
                metrics[name] = metrics.get(name, 0) + value
    return {**metrics, **prefill_counts(completions)}

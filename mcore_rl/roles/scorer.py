"""Scoring: rule rewards and a reward model through one path.

Every rank of a data shard's group (TP x CP x PP) holds the same generation (the shard's
prompts are generated once and shared: rl/shard_parts.py), so only its scores travel: the
group's first rank scores it with the rule rewards (sandboxed workers run only there) and
broadcasts the results to the group. A reward model is itself model-parallel, so it scores on every rank, after the
hand-over; the rule rewards, where the data sources have them, then still check each response
against its ground truth (`RewardResult.correct`), so that accuracy is measured, not read off
the reward model's score.
"""

from __future__ import annotations

import torch.distributed as dist

from mcore_rl.rewards import RewardResult
from mcore_rl.rollout import Generation

from .reward import RuleReward
from .reward_model import RewardModel


class Scorer:
    """One RewardResult per completion, identical on every rank of a data shard's group."""

    def __init__(self, rule_reward: RuleReward | None, reward_model: RewardModel | None,
                 pad_id: int, shard_group):
        self.rule_reward = rule_reward
        """The rule rewards (only on the group's first rank): the reward, or with a reward
        model only the ground-truth check (None where the data sources have no rule)."""
        self.reward_model = reward_model
        self.pad_id = pad_id
        self.group = shard_group
        self.source = dist.get_process_group_ranks(shard_group)[0]
        """The global rank whose rule scores the group adopts."""

    def score(self, generation: Generation, records: list, tag: str
              ) -> tuple[Generation, list[RewardResult]]:
        """The group's generation (the same on each of its ranks) and its scores; `tag`
        prefixes the sample ids in the sandbox's logs."""
        payload = [None]
        if dist.get_rank() == self.source and self.rule_reward is not None:
            payload = [self.rule_reward.score(generation, records, tag)]
        if dist.get_world_size(self.group) > 1:
            dist.broadcast_object_list(payload, src=self.source, group=self.group)
        results = payload[0]
        if self.reward_model is not None:
            rows = generation.response_tensors(self.pad_id)
            scores = self.reward_model.score(rows["input_ids"], rows["attention_mask"]).tolist()
            checks = [result.correct for result in results] if results else [None] * len(scores)
            results = [RewardResult(float(score), correct=correct)
                       for score, correct in zip(scores, checks)]
        return generation, results

    def close(self) -> None:
        """Stop the rule rewards' worker processes."""
        if self.rule_reward is not None:
            self.rule_reward.rewards.close()

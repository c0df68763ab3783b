"""Rule rewards for groups of responses as they finish, beside generation.

On the rollout ranks the engine keeps generating while finished groups are scored: each group
goes to one background thread that hands it to the sandboxed reward workers (the thread mostly
waits on their pipes, so it does not hold the engine up). A share is sent once every one of its
groups has its scores. Only an engine instance's leader scores (the sandbox runs there).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses

from mcore_rl.roles import RuleReward
from mcore_rl.rollout import Generation

from .book import OpenShare, ShareKey


class GroupScorer:
    """Scores complete groups in a background thread (one at a time, in submission order)."""

    def __init__(self, rule_reward: RuleReward):
        self.rule_reward = rule_reward
        self._thread = concurrent.futures.ThreadPoolExecutor(1, "mcore_rl-scoring")
        self._scores: dict[ShareKey, dict[int, concurrent.futures.Future]] = {}

    def submit(self, share: OpenShare, position: int) -> None:
        """Score the (complete) group of prompt `position` of `share`."""
        completions = [dataclasses.replace(c, prompt_index=0) for c in share.group(position)]
        generation = Generation(completions, [share.prompts[position]])
        future = self._thread.submit(self.rule_reward.score, generation,
                                     [share.records[position]], f"{share.kind}{share.index}")
        self._scores.setdefault((share.kind, share.index), {})[position] = future

    def ready(self, share: OpenShare) -> bool:
        futures = self._scores.get((share.kind, share.index), {})
        return len(futures) == len(share.prompts) and all(f.done() for f in futures.values())

    def results(self, share: OpenShare) -> list:
        """Every response's RewardResult, by prompt then sample (waits for the scoring)."""
        futures = self._scores.pop((share.kind, share.index))
        return [result for position in range(len(share.prompts))
                for result in futures[position].result()]

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)
        self.rule_reward.rewards.close()

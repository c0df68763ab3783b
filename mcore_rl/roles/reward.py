"""The reward role for rule-based (verifiable) rewards: decode each response, score it with the
function registered for its prompt's data_source, in sandboxed worker processes.

A function sees the prompt it scores as extra_info["prompt"] (text or chat messages; a data
row's own extra_info["prompt"] is kept), so prompt-dependent rewards need no dataset column."""

from __future__ import annotations

import dataclasses

from mcore_rl.evaluation import is_correct
from mcore_rl.rewards import RewardRequest, RuleRewards
from mcore_rl.rollout import Generation


class RuleReward:
    """Scores generations against their prompt records' ground truths."""

    def __init__(self, rewards: RuleRewards, tokenizer):
        self.rewards = rewards
        self.tokenizer = tokenizer

    def score(self, generation: Generation, records: list, sample_prefix: str) -> list:
        """One RewardResult per completion, in order, `correct` when its score is at least
        evaluation.CORRECT_SCORE. Failed or timed-out calls score 0 with an error (the sandbox
        logs them with their sample ids)."""
        requests = []
        for completion in generation.completions:
            record = records[completion.prompt_index]
            requests.append(RewardRequest(
                sample_id=f"{sample_prefix}/record{record.index}/sample{completion.sample_index}",
                data_source=record.data_source,
                response=self.tokenizer.decode(completion.token_ids, skip_special_tokens=True),
                ground_truth=record.ground_truth,
                extra_info={"prompt": record.prompt, **record.extra_info}))
        return [dataclasses.replace(result, correct=is_correct(result.score))
                for result in self.rewards.score(requests)]

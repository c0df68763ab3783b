"""The reward role for rule-based (verifiable) rewards: decode each response, score it with the
function registered for its prompt's data_source, in sandboxed worker processes.

A function sees the prompt it scores as extra_info["prompt"] (text or chat messages; a data
row's own extra_info["prompt"] is kept), so prompt-dependent rewards need no dataset column; a
multi-turn episode's function scores its final assistant message and sees the whole
conversation as extra_info["messages"] (an episode its environment scored skips the function).
"""

from __future__ import annotations

import dataclasses

from mcore_rl.evaluation import is_correct
from mcore_rl.rewards import RewardRequest, RewardResult, RuleRewards
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
        requests, scored_by_environment = [], {}
        for position, completion in enumerate(generation.completions):
            episode = completion.episode or {}
            if episode.get("reward") is not None:
                scored_by_environment[position] = RewardResult(float(episode["reward"]))
                continue
            record = records[completion.prompt_index]
            extra = {"messages": episode["messages"]} if "messages" in episode else {}
            requests.append(_request(
                record, f"{sample_prefix}/record{record.index}/sample{completion.sample_index}",
                self._response(completion), extra))
        scored = iter(self.rewards.score(requests) if requests else [])
        results = [scored_by_environment.get(position) or next(scored)
                   for position in range(len(generation.completions))]
        return [dataclasses.replace(result, correct=is_correct(result.score))
                for result in results]

    def probe(self, records: list) -> None:
        """Run each data source's function once in its sandbox on the data source's first row,
        with the row's ground truth as the response; ValueError naming the row, the error and
        the reward.* setting that would allow it."""
        first = {}
        for record in records:
            first.setdefault(record.data_source, record)
        self.rewards.probe([_request(record, f"row {record.index}", record.ground_truth
                                     if isinstance(record.ground_truth, str) else "")
                            for record in first.values()])

    def _response(self, completion) -> str:
        """The text a reward function scores: the response, or an episode's final assistant
        message (its token ids hold the observations too)."""
        if completion.response_text is not None:
            return completion.response_text
        return self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)


def _request(record, sample_id: str, response: str, extra: dict | None = None
             ) -> RewardRequest:
    """The reward call for `response` to `record`: its extra_info with the prompt (a row's own
    extra_info["prompt"] kept) and `extra` (an episode's messages)."""
    return RewardRequest(sample_id=sample_id, data_source=record.data_source, response=response,
                         ground_truth=record.ground_truth,
                         extra_info={"prompt": record.prompt, **record.extra_info,
                                     **(extra or {})})

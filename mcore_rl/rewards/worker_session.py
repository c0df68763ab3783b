"""What runs inside one reward worker: a session of the sandbox (mcore_rl.sandbox), a confined
process forked from the rewards' zygote.

A reward function parses what the model wrote (math answers, code, JSON), so it is as untrusted
as a tool: it gets no network unless `reward.network`, writes only beneath its own directory,
sees none of the rank's secrets, and its reply reaches the rank as plain data (a score, an error
and numbers), never as an object the rank would unpickle.

Requests, in order, one at a time: (LOAD, data_source) imports and prepares that data source's
function (worker_pool.py gives it reward.startup_timeout_seconds), (SCORE, RewardRequest) scores
one response (reward.timeout_seconds).
"""

from __future__ import annotations

from typing import Any

from .scoring import Scorer

LOAD, SCORE = "load", "score"


class RewardSession:
    """The session's handler: a Scorer (sent by the rank when the session opens)."""

    def __init__(self, scorer: Scorer):
        self.scorer = scorer

    def __call__(self, message: tuple) -> Any:
        kind, payload = message
        if kind == LOAD:
            self.scorer.function_for(payload)
            return None
        result = self.scorer.score(payload)
        return {"score": result.score, "error": result.error, "details": result.details}

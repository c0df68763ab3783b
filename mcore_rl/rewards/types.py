"""What goes into a reward call and what comes out. A request goes to a worker pickled; a result
comes back as plain data, rebuilt and checked by the rank (worker_pool.py). A result always
exists: a failed call is a result with score 0 and an error, never an exception in the
trainer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

RewardFunction = Callable[[str, str, Any, dict], Union[float, dict]]
"""verl's compute_score signature: fn(data_source, solution_str, ground_truth, extra_info)
returning a number or a dict with a "score" entry (its other numeric entries become details)."""


@dataclass(frozen=True)
class RewardRequest:
    """One response to score."""

    sample_id: str
    """Names the sample in error logs, e.g. "step3/rank0/prompt5/sample2"."""

    data_source: str
    """Picks the reward function (the dataset row's data_source)."""

    response: str
    """The decoded response text, without the prompt."""

    ground_truth: Any = None
    """The row's reward_model.ground_truth: JSON-like (str, number, list, dict) or None."""

    extra_info: dict = field(default_factory=dict)
    """The row's extra_info (JSON-like), e.g. the reasoning-gym entry."""


@dataclass(frozen=True)
class RewardResult:
    """The outcome of one reward call."""

    score: float
    """The reward; 0.0 when the function failed or timed out."""

    error: Optional[str] = None
    """None on success, else a one-line reason ("timeout after 5.0 s", "ValueError: ...")."""

    details: dict = field(default_factory=dict)
    """Other numbers the function returned (e.g. {"acc": 1.0}), plus "correctness" and "format"
    when the format reward is on; empty if none."""

    correct: Optional[bool] = None
    """Whether a check against the row's ground truth found the response right (a rule reward's
    score >= 1.0, set by the reward role); None where nothing checked it (a reward model's score
    without rule functions for the data source). Accuracy metrics count only checked responses:
    a reward model's score is a reward, never a correctness."""

    @staticmethod
    def failed(error: str) -> "RewardResult":
        return RewardResult(score=0.0, error=error, details={})


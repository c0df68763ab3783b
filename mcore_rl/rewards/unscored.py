"""The reward of data nothing scores in pure on-policy distillation (teacher.reward_weight=0):
the teacher's per-token advantage is the whole signal, so a data source needs no reward
function; its responses score 0 and are not checked (no accuracy is logged for them)."""

from __future__ import annotations

from typing import Any

UNSCORED = "mcore_rl.rewards.unscored:unscored"
"""Its dotted path, as reward.default_function takes it."""


def unscored(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict) -> float:
    """0.0 for every response."""
    return 0.0

"""The toy copy task ("copy 7" -> "7") that tiny random models learn in the CPU tests: a reward
that a word-level policy can climb one token at a time."""

from __future__ import annotations

from typing import Any


def copy_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict) -> float:
    """Fraction of the response's whitespace-separated words equal to str(ground_truth) (0.0 for
    an empty response)."""
    words = solution_str.split()
    if not words:
        return 0.0
    target = str(ground_truth)
    return sum(word == target for word in words) / len(words)

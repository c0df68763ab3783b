"""The format reward: a bonus for responses shaped the way the prompt asked (by default
DeepSeek-R1's "<think>...</think> <answer>...</answer>"), mixed into the correctness score as

    score = (1 - format_weight) * correctness + format_weight * format,   format in {0, 1},

so a score in [0, 1] stays in [0, 1], and format_weight = 0 leaves the correctness untouched.
"""

from __future__ import annotations

import re


def compile_format_pattern(pattern: str) -> re.Pattern:
    """The pattern as matched against whole responses (DOTALL: reasoning spans lines)."""
    return re.compile(pattern, re.DOTALL)


def format_score(response: str, pattern: re.Pattern) -> float:
    """1.0 when the whole response matches the pattern, else 0.0."""
    return 1.0 if pattern.fullmatch(response) else 0.0


def mix_format_reward(correctness: float, details: dict, format_value: float,
                      weight: float) -> tuple[float, dict]:
    """(score, details) with the format reward mixed in; details keep both parts."""
    score = (1.0 - weight) * correctness + weight * format_value
    return score, {**details, "correctness": correctness, "format": format_value}

"""reasoning-gym's procedural tasks (data_source "reasoning_gym/<task>") scored by the task's own
score_answer, so a reward here is exactly what reasoning-gym's evaluations report.

The prompt row carries the generated entry (question, answer, metadata) in
extra_info["reasoning_gym_entry"], as a dict or its JSON text: many tasks score against the
metadata, not just the answer string. The answer is the content of the last <answer>...</answer>
tags (reasoning_gym.utils.extract_answer), or the whole response stripped when it has none.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any, Callable

# Imported here, not per call: workers load this module before the call's timeout starts.
import reasoning_gym
from reasoning_gym.utils import extract_answer

DATA_SOURCE_PREFIX = "reasoning_gym/"
ENTRY_KEY = "reasoning_gym_entry"


def reasoning_gym_score(data_source: str, solution_str: str, ground_truth: Any,
                        extra_info: dict) -> float:
    """The task's score_answer(answer, entry), in [0, 1]."""
    entry = _entry(extra_info)
    answer = extract_answer(solution_str)
    if answer is None:
        answer = solution_str.strip()
    return float(_score_answer_fn(task_name(data_source))(answer, entry))


def task_name(data_source: str) -> str:
    """"reasoning_gym/chain_sum" -> "chain_sum"."""
    if not data_source.startswith(DATA_SOURCE_PREFIX):
        raise ValueError(f"data_source {data_source!r} does not start with {DATA_SOURCE_PREFIX!r}")
    return data_source[len(DATA_SOURCE_PREFIX):]


def prepare(data_source: str) -> None:
    """Build the task's scorer once per worker, before the first timed call."""
    _score_answer_fn(task_name(data_source))


reasoning_gym_score.prepare = prepare


@lru_cache(maxsize=None)
def _score_answer_fn(task: str) -> Callable[[str | None, dict], float]:
    return reasoning_gym.get_score_answer_fn(task)


def _entry(extra_info: dict) -> dict:
    entry = (extra_info or {}).get(ENTRY_KEY)
    if entry is None:
        raise ValueError(f"reasoning-gym data sources need extra_info[{ENTRY_KEY!r}] (the "
                         "generated entry: question, answer, metadata)")
    return json.loads(entry) if isinstance(entry, str) else entry

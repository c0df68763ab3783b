"""reasoning-gym tasks as a built-in prompt source.

reasoning-gym generates questions with verifiable answers procedurally, so RL runs need no
dataset files. Each entry becomes a chat prompt (reasoning-gym's system prompt asking for the
answer in <answer> tags, then the question) and carries the whole entry in
extra_info["reasoning_gym_entry"]: the reward calls the task's own
`score_answer(answer, entry)` with it.

The stored entry is the JSON round trip of the generated one, so the scorer sees the same entry
whether it was kept in memory, checkpointed or written to a file. A task whose entries do not
survive that trip (metadata with tuples or objects that its scorer compares by type) is refused
at load time, by checking that its own answers still score the same afterwards.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from mcore_rl.config.data import ReasoningGymConfig

from .records import DataError, PromptRecord

ENTRY_KEY = "reasoning_gym_entry"
# Entries per task whose answers are re-scored after the JSON round trip at load time.
ROUND_TRIP_CHECKS = 4


def reasoning_gym_records(config: ReasoningGymConfig, size: int, seed: int,
                          start_index: int = 0) -> list[PromptRecord]:
    """`size` records of every task in config.tasks (task by task, indexed from
    `start_index`), generated with `seed`."""
    system_prompt = _system_prompt(config.system_prompt)
    records = []
    for task in config.tasks:
        dataset = _create(task, size, seed, config.task_kwargs.get(task, {}))
        for position in range(size):
            entry = _json_entry(task, position, dataset[position])
            if position < ROUND_TRIP_CHECKS:
                _check_round_trip(task, position, dataset, dataset[position], entry)
            records.append(PromptRecord(
                index=start_index + len(records),
                prompt=_messages(system_prompt, entry["question"]),
                data_source=f"reasoning_gym/{task}",
                ground_truth=entry["answer"],
                extra_info={ENTRY_KEY: entry}))
    return records


def _system_prompt(configured: Optional[str]) -> str:
    if configured is not None:
        return configured
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS["default"]


def _messages(system_prompt: str, question: str) -> list[dict[str, str]]:
    user = [{"role": "user", "content": question}]
    return ([{"role": "system", "content": system_prompt}] + user) if system_prompt else user


def _create(task: str, size: int, seed: int, kwargs: dict[str, Any]):
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(task, size=size, seed=seed, **kwargs)
    except Exception as error:  # the task's own config validation: TypeError, AssertionError...
        settings = "".join(f", {key}={value!r}" for key, value in kwargs.items())
        raise DataError(f"reasoning-gym task {task!r} cannot be created with size={size}, "
                        f"seed={seed}{settings} (data.reasoning_gym.task_kwargs): "
                        f"{type(error).__name__}: {error}") from None


def _json_entry(task: str, position: int, entry: dict[str, Any]) -> dict[str, Any]:
    kept = {key: entry.get(key) for key in ("question", "answer", "metadata")}
    try:
        return json.loads(json.dumps(kept))
    except (TypeError, ValueError) as error:
        raise DataError(f"reasoning-gym task {task!r}: entry {position} is not JSON-"
                        f"serialisable ({error}); this task is not supported") from None


def _check_round_trip(task: str, position: int, dataset, original: dict[str, Any],
                      stored: dict[str, Any]) -> None:
    before = dataset.score_answer(original["answer"], original)
    after = dataset.score_answer(stored["answer"], stored)
    if before != after:
        raise DataError(f"reasoning-gym task {task!r}: entry {position} scores its own answer "
                        f"{before} but {after} after a JSON round trip (its metadata holds "
                        "types JSON does not keep); this task is not supported")

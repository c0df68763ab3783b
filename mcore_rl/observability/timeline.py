"""The run's timeline: when each rank ran each phase of each step (generate, switch, reshard,
reward, logprobs, advantages, update, ...), so a plot shows what overlapped and who waited.

Every rank hands its step's phase intervals to one all-gather over the world; rank 0 appends one
line per interval to RUN_DIR/timeline.jsonl:

    {"step": 3, "rank": 1, "phase": "generate", "start": 1.7e9, "end": 1.7e9, "recorded": 1.7e9}

Times are Unix seconds (time.time()), comparable between the ranks of a job on clocks kept in
step (one machine, or NTP across nodes). A gap in a rank's row is time outside every phase:
waiting in a collective for a slower rank, or bookkeeping. A resumed run appends again; readers
keep the last recording of each step.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch.distributed as dist

TIMELINE_FILE = "timeline.jsonl"
ROLLOUT_TIMELINE_FILE = "timeline_rollout.jsonl"
"""Split placement: the rollout ranks' phases, written by their first rank (steps are the
policy versions the rollout ranks held)."""

MERGE_GAP_SECONDS = 0.01
"""Consecutive intervals of one phase closer than this are recorded as one."""


class Timeline:
    """Records every rank's phases per step (collective over `group`: every rank of it calls
    `record`). In split placement each side records its own ranks into its own file."""

    def __init__(self, output_dir: str, file_name: str = TIMELINE_FILE, first_rank: int = 0,
                 group=None):
        """first_rank: the job rank of the group's rank 0 (rows carry job ranks)."""
        self.path = os.path.join(output_dir, file_name)
        self.first_rank = first_rank
        self.group = group
        self._file = None
        if dist.get_rank(group) == 0:
            os.makedirs(output_dir, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")

    def record(self, step: int, intervals: list[tuple[str, float, float]]) -> None:
        everyone = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, _merged(intervals), group=self.group)
        if self._file is None:
            return
        recorded = time.time()
        for rank, rank_intervals in enumerate(everyone, start=self.first_rank):
            for phase, start, end in rank_intervals:
                self._file.write(json.dumps({"step": step, "rank": rank, "phase": phase,
                                             "start": start, "end": end,
                                             "recorded": recorded}) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _merged(intervals: list[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
    merged: list[tuple[str, float, float]] = []
    for phase, start, end in sorted(intervals, key=lambda interval: interval[1]):
        if merged and merged[-1][0] == phase and start - merged[-1][2] < MERGE_GAP_SECONDS:
            merged[-1] = (phase, merged[-1][1], max(end, merged[-1][2]))
        else:
            merged.append((phase, start, end))
    return merged


def read_timeline(run_dir: str | os.PathLike, last_steps: int) -> list[dict]:
    """The intervals of the run's last `last_steps` recorded steps (the newest recording of a
    step that was recorded twice), the trainers' first, then (split placement) the rollout
    ranks' intervals that overlap those steps' time, marked "side": "rollout" (their step
    numbers are the policy versions they held, which run ahead of the trainers' steps, so they
    are picked by time). [] without a timeline. A torn last line (a run killed while writing it) is skipped."""
    trainer = _read_steps(Path(run_dir) / TIMELINE_FILE)
    rollout = _read_steps(Path(run_dir) / ROLLOUT_TIMELINE_FILE)
    if not trainer:
        steps = sorted(rollout)[-last_steps:]
        return [row for step in steps for row in rollout[step]]
    rows = [row for step in sorted(trainer)[-last_steps:] for row in trainer[step]]
    begin, end = min(row["start"] for row in rows), max(row["end"] for row in rows)
    return rows + [dict(row, side="rollout") for step in sorted(rollout)
                   for row in rollout[step] if row["end"] > begin and row["start"] < end]


def _read_steps(path: Path) -> dict[int, list[dict]]:
    if not path.is_file():
        return {}
    by_step: dict[int, list[dict]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        rows = by_step.setdefault(row["step"], [])
        if rows and rows[0]["recorded"] != row["recorded"]:
            rows.clear()  # the step recorded again (a resumed run): keep the newest
        rows.append(row)
    return by_step

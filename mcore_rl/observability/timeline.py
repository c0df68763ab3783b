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


class Timeline:
    """Records every rank's phases per step (collective: every rank calls `record`)."""

    def __init__(self, output_dir: str):
        self.path = os.path.join(output_dir, TIMELINE_FILE)
        self._file = None
        if dist.get_rank() == 0:
            os.makedirs(output_dir, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")

    def record(self, step: int, intervals: list[tuple[str, float, float]]) -> None:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, list(intervals))
        if self._file is None:
            return
        recorded = time.time()
        for rank, rank_intervals in enumerate(everyone):
            for phase, start, end in rank_intervals:
                self._file.write(json.dumps({"step": step, "rank": rank, "phase": phase,
                                             "start": start, "end": end,
                                             "recorded": recorded}) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def read_timeline(run_dir: str | os.PathLike, last_steps: int) -> list[dict]:
    """The intervals of the run's last `last_steps` recorded steps (the newest recording of a
    step that was recorded twice), in file order; [] without a timeline. A torn last line (a
    run killed while writing it) is skipped."""
    path = Path(run_dir) / TIMELINE_FILE
    if not path.is_file():
        return []
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
    steps = sorted(by_step)[-last_steps:]
    return [row for step in steps for row in by_step[step]]

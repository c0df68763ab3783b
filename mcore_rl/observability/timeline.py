"""The run's timeline: when each rank ran each phase of each step (generate, switch, reshard,
reward, logprobs, advantages, update, ...), so a plot shows what overlapped and who waited.

Every rank hands its step's phase intervals to an all-gather over the world (tensors on the
group's device: the times as float64, the phase names as their UTF-8 bytes; no pickling per
step); rank 0 appends one line per interval to RUN_DIR/timeline.jsonl:

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

import torch
import torch.distributed as dist

from mcore_rl.runtime.devices import collective_device

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
        everyone = _gather_intervals(_merged(intervals), self.group, self._file is not None)
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


def _gather_intervals(intervals: list[tuple[str, float, float]], group, decode: bool
                      ) -> list[list[tuple[str, float, float]]]:
    """Every rank's intervals (collective over `group`; [] per rank unless `decode`). A rank's
    are one float64 tensor: their count, start and end of each (Unix seconds as the floats
    Python holds them, exactly), then the bytes of their phase names joined by newlines. One
    all_gather of the lengths, one of the tensors padded to the longest."""
    device = collective_device(group)
    names = "\n".join(phase for phase, _, _ in intervals).encode()
    flat = torch.tensor([len(intervals), *(moment for _, start, end in intervals
                                           for moment in (start, end)), *names],
                        dtype=torch.float64, device=device)
    world = dist.get_world_size(group)
    length = torch.tensor([flat.numel()], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    lengths = torch.cat(lengths).tolist()
    padded = torch.zeros(max(lengths), dtype=torch.float64, device=device)
    padded[:flat.numel()] = flat
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    if not decode:
        return [[] for _ in range(world)]
    everyone = []
    for tensor, used in zip(gathered, lengths):
        values = tensor[:used].tolist()
        count = int(values[0])
        if not count:
            everyone.append([])
            continue
        times = values[1:1 + 2 * count]
        phases = bytes(int(byte) for byte in values[1 + 2 * count:]).decode().split("\n")
        everyone.append([(phase, times[2 * i], times[2 * i + 1])
                         for i, phase in enumerate(phases)])
    return everyone


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

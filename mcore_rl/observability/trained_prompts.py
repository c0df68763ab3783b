"""trained_prompts.jsonl: which rows of the training data each step trained on.

    {"step": 3, "prompts": [17, 201, 388, ...]}      dataset indices (PromptRecord.index), sorted

For audits (which data shaped this checkpoint) and for the chaos test (bench/chaos.py), which
shows with it that a run killed and resumed any number of times trains every prompt exactly
once, also where rollouts run ahead of training (split placement, rollout.max_staleness >= 1).
A resumed run appends again from its checkpoint on; readers keep the last line of each step, as
for metrics.jsonl (run_files).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as dist

from .run_files import drop_unterminated_tail, last_line_per_step, read_jsonl

TRAINED_PROMPTS_FILE = "trained_prompts.jsonl"


class TrainedPromptsLog:
    """Every rank of `group` (the data-parallel group) calls `record` at the same point of each
    step; the group's rank 0 that is also the job's rank 0 writes the line."""

    def __init__(self, output_dir: str, group=None):
        self.group = group
        self._file = None
        if dist.get_rank() == 0:
            path = os.path.join(output_dir, TRAINED_PROMPTS_FILE)
            os.makedirs(output_dir, exist_ok=True)
            if os.path.exists(path):
                drop_unterminated_tail(Path(path))
            self._file = open(path, "a", encoding="utf-8")

    def record(self, step: int, records: list) -> None:
        """The prompts this rank trained at `step` (PromptRecords); collective over the group."""
        everyone = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, [record.index for record in records], group=self.group)
        if self._file is not None:
            prompts = sorted(index for indices in everyone for index in indices)
            self._file.write(json.dumps({"step": step, "prompts": prompts}) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def read_trained_prompts(run_dir: str) -> dict[int, list[int]]:
    """step -> the dataset indices it trained on (the last line written for each step)."""
    path = os.path.join(run_dir, TRAINED_PROMPTS_FILE)
    if not os.path.exists(path):
        return {}
    return {record["step"]: record["prompts"]
            for record in last_line_per_step(read_jsonl(path))}

"""One rank of an RL training world (run by tests/test_rl_learning.py and the resume test).

Builds the job from `configs/grpo_toy.yaml` plus overrides, runs `Trainer.fit()` with held-out
evaluation before the first and after the last step, and rank 0 saves the history.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from mcore_rl.config import load_config
from mcore_rl.trainer import Trainer

TOY_CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "grpo_toy.yaml")


def train(out_path: str, overrides: list[str]) -> None:
    trainer = Trainer(load_config(TOY_CONFIG, overrides))
    before = trainer.evaluate()
    history = trainer.fit()
    after = trainer.evaluate()
    if dist.get_rank() == 0:
        torch.save({"before": before, "after": after, "history": history}, out_path)
    trainer.close()

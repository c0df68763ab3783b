"""Rank code for tests/test_preference.py: the preference jobs one after another in one spawned
world (each job starts and ends its own process group, on its own port), then the trained
reward model loaded back through reward.model_path."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def run_jobs(jobs: list[tuple[str, list[str], int]], scoring: tuple[str, str, int]) -> None:
    """jobs: (rm or dpo, overrides, port) run in order; scoring: (output file, HF reward-model
    folder, port): rank 0 saves that model's Megatron scores of fixed rows (TP2)."""
    from mcore_rl.config import load_config
    from mcore_rl.preference import DpoTrainer, RewardModelTrainer

    for job, overrides, port in jobs:
        os.environ["MASTER_PORT"] = str(port)
        trainer = RewardModelTrainer if job == "rm" else DpoTrainer
        trainer(load_config(None, overrides)).fit()
    out_path, model_path, port = scoring
    os.environ["MASTER_PORT"] = str(port)
    reward_model_scores(out_path, model_path)


def scoring_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded rows of the toy vocabulary (ids 3..13), lengths 5, 3, 6 and 4."""
    ids = torch.tensor([[3, 5, 9, 4, 1, 0], [3, 12, 6, 0, 0, 0], [3, 7, 7, 13, 8, 1],
                        [3, 11, 4, 1, 0, 0]])
    return ids, (ids != 0).long()


def reward_model_scores(out_path: str, model_path: str) -> None:
    from mcore_rl.config import JobConfig, ParallelConfig
    from mcore_rl.config.reward import RewardConfig
    from mcore_rl.conversion.sequence_classifier import open_sequence_classifier
    from mcore_rl.rl.build import build_reward_model
    from mcore_rl.runtime import initialize, shutdown

    model = open_sequence_classifier(model_path)[2]
    config = JobConfig(model=model, parallel=ParallelConfig(tensor_model_parallel_size=2),
                       reward=RewardConfig(model_path=model_path))
    runtime = initialize(config)
    scores = build_reward_model(config, runtime).score(*scoring_rows())
    if dist.get_rank() == 0:
        torch.save(scores, out_path)
    shutdown()

"""`mcore-rl train` on one rank: the same call on every rank of the job.

Colocated, every rank runs the Trainer. In split placement the trainer ranks run the Trainer
and the rollout ranks run the rollout loop (rl.split); the trainers decide when the job ends
and with which exit status, and tell the rollout ranks.
"""

from __future__ import annotations

from mcore_rl.config import JobConfig
from mcore_rl.runtime import read_launch_env
from mcore_rl.runtime.preemption import PREEMPTED_EXIT_CODE

from .split.rollout_worker import run_rollout_ranks
from .trainer import Trainer

FAILED_EXIT_CODE = 1


def run_training(config: JobConfig, reward_fn=None) -> int:
    """Train (or generate, on a rollout rank) until trainer.total_steps or a save signal;
    returns the process's exit status (PREEMPTED_EXIT_CODE after a save for requeueing)."""
    launch = read_launch_env()
    if config.placement.split and \
            config.placement.side_of(launch.rank, launch.world_size) == "rollout":
        return run_rollout_ranks(config, reward_fn)
    trainer = Trainer(config, reward_fn=reward_fn)
    try:
        trainer.fit()
    except BaseException:
        trainer.abandon(FAILED_EXIT_CODE)
        raise
    trainer.close()
    return PREEMPTED_EXIT_CODE if trainer.preempted else 0

"""One rank of a split-placement RL job (run by tests/test_split_placement.py).

Every rank calls `train`: the trainer ranks run the Trainer (its rollout scheduler wrapped to
record, for every step, which prompts arrived and the policy versions each response was sampled
with), the rollout ranks run the rollout loop; each rank saves what it saw to OUT.<job rank>.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from mcore_rl.config import load_config
from mcore_rl.rl import Trainer
from mcore_rl.rl.split.protocol import Fetch
from mcore_rl.rl.split.rollout_worker import RolloutWorker, run_rollout_ranks
from mcore_rl.runtime import read_launch_env

TOY_CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "grpo_toy.yaml")


def train(out_path: str, overrides: list[str], signal_after_step: int = 0,
          fail_rollout_at_batch: int = -1, own_version_gaps: bool = False) -> None:
    """Train; with signal_after_step, SIGUSR1 reaches trainer rank 0 after that step (as SLURM's
    preemption notice would). With fail_rollout_at_batch, the rollout ranks raise when the
    trainers ask for that batch, and every rank saves the error it ended with (and exits
    normally, so that no launcher ends the others for it). With own_version_gaps (one trainer
    rank), every step also records the largest engine/trainer log-prob gap of the tokens each
    policy version sampled, scored by the trainer with that version's weights."""
    config = load_config(TOY_CONFIG, overrides)
    launch = read_launch_env()
    if launch.rank >= launch.world_size - config.placement.rollout_ranks:
        if fail_rollout_at_batch < 0:
            torch.save({"exit_code": run_rollout_ranks(config)}, f"{out_path}.{launch.rank}")
            return
        worker = RolloutWorker(config)
        handle = worker._handle

        def failing_handle(message):
            if isinstance(message, Fetch) and message.batch == fail_rollout_at_batch:
                raise RuntimeError(f"injected failure at batch {message.batch}")
            handle(message)

        worker._handle = failing_handle
        with pytest.raises(RuntimeError) as error:
            worker.run()
        torch.save({"error": str(error.value)}, f"{out_path}.{launch.rank}")
        return
    trainer = Trainer(config)
    if fail_rollout_at_batch >= 0:
        with pytest.raises(RuntimeError) as error:
            trainer.fit()
        torch.save({"error": str(error.value)}, f"{out_path}.{launch.rank}")
        return
    seen = []
    next_batch = trainer.scheduler.next
    weights = {}
    """Policy version -> the actor's parameters then (own_version_gaps)."""

    def recording_next(step, timer, stats, prompts=None):
        if own_version_gaps:
            weights[step] = {name: parameter.detach().clone() for name, parameter
                             in trainer.roles.actor.module.named_parameters()}
        rollout = next_batch(step, timer, stats, prompts)
        seen.append({"step": step, "prompts": [record.index for record in rollout.records],
                     "versions": [completion.versions
                                  for completion in rollout.generation.completions]})
        if own_version_gaps:
            seen[-1]["gaps"] = gaps_by_version(trainer, rollout, weights)
        return rollout

    trainer.scheduler.next = recording_next
    if signal_after_step:
        train_step = trainer.train_step

        def step_then_signal():
            metrics = train_step()
            if trainer.step == signal_after_step and launch.rank == 0:
                os.kill(os.getpid(), signal.SIGUSR1)
            return metrics

        trainer.train_step = step_then_signal
    history = trainer.fit()
    trainer.close()
    torch.save({"history": history, "seen": seen, "preempted": trainer.preempted},
               f"{out_path}.{launch.rank}")


def gaps_by_version(trainer: Trainer, rollout, weights: dict) -> dict[int, float]:
    """For each policy version that sampled tokens of `rollout`: the largest |engine log-prob -
    trainer log-prob| over those tokens, the trainer scoring with that version's weights
    (loaded into the actor for the pass, the current ones put back after)."""
    from mcore_rl.rl.experience import make_experience

    batch = make_experience(rollout.generation, rollout.scores, trainer.config.rollout,
                            trainer.data.pad_id)
    versions = rollout.generation.token_versions(rollout.version)
    sampled = batch["response_mask"].bool()
    parameters = dict(trainer.roles.actor.module.named_parameters())
    gaps = {}
    with torch.no_grad():
        for version in sorted(set(versions[sampled].tolist())):
            for name, parameter in parameters.items():
                parameter.copy_(weights[version][name])
            logprobs = trainer.roles.actor.logprobs(batch)["logprobs"]
            mine = sampled & (versions == version)
            gaps[version] = float((logprobs - batch["engine_logprobs"]).abs()[mine].max())
        for name, parameter in parameters.items():
            parameter.copy_(weights[max(weights)][name])
    return gaps

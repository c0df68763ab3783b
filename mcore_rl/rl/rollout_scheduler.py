"""How a step's batch is produced: the rollout scheduler the RL step calls.

    synchronous         generate and score the sampler's next prompts with the current policy
    one step ahead      (rollout.async_rollout) train on the batch generated during the
                        previous step and generate the next one now; the importance weight
                        (rollout.importance_*) corrects for the lag
    dynamic sampling    (rollout.dynamic_sampling) DAPO's: keep only groups whose rewards
                        differ, generating more rounds until every data-parallel rank has a
                        full batch of them

Sampling seeds follow the step (and the round), so a resumed run draws what an uninterrupted
one would; the batch generated ahead is part of the checkpoint (`state_dict`).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from mcore_rl.agents import EpisodeRunner
from mcore_rl.config import JobConfig
from mcore_rl.config.rollout import SamplingConfig
from mcore_rl.observability.step_metrics import PhaseTimer, SumsAndCounts
from mcore_rl.roles import Scorer
from mcore_rl.runtime import print0
from mcore_rl.runtime.devices import collective_device

from .data import TrainingData
from .experience import Rollout, select_groups, varied_groups
from .generator import PolicyGenerator


class RolloutScheduler:
    """This rank's scored rollouts, one batch per step."""

    def __init__(self, config: JobConfig, data: TrainingData, generator: PolicyGenerator,
                 scorer: Scorer, dp_group, episodes: EpisodeRunner | None = None):
        self.config = config
        self.data = data
        self.generator = generator
        self.scorer = scorer
        self.dp_group = dp_group
        self.episodes = episodes
        """Multi-turn rollouts: the runner of this rank's episodes, an EpisodeRunner or an
        AgentRunner (None: one response per prompt)."""
        self.pending: Rollout | None = None
        """With async_rollout: the batch generated ahead for the next step (this rank's)."""

    def next(self, step: int, timer: PhaseTimer, stats: SumsAndCounts,
             prompts: list | None = None) -> Rollout:
        """The batch step `step` trains on: this rank's share of `prompts` (a global list of
        texts or PromptRecords) or the sampler's next prompts, as configured."""
        if prompts is not None:
            return self.rollout(*self.data.encode_global(prompts), step, timer)
        if self.config.rollout.async_rollout:
            return self._one_step_ahead(step, timer)
        if self.config.rollout.dynamic_sampling:
            return self._varied_groups(step, timer, stats)
        return self.rollout(*self.data.next_batch(), step, timer)

    def rollout(self, records: list, token_ids: list, step: int, timer: PhaseTimer,
                round_index: int = 0) -> Rollout:
        """Generate and score one round of prompts."""
        sampling = training_sampling(self.config, self.data.stop_token_ids, step, round_index)
        generation = self._generate(records, token_ids, sampling, timer)
        with timer("reward"):
            generation, results = self.scorer.score(generation, records, f"step{step}")
        return Rollout(records, token_ids, generation, results, version=step)

    def validation(self, step: int) -> tuple[list, object, list]:
        """This rank's validation prompts answered with the current policy and scored:
        (records, generation, results)."""
        records, token_ids = self.data.validation_shard()
        with self.generator.uncounted():
            generation = self._generate(records, token_ids, evaluation_sampling(
                self.config, self.data.stop_token_ids))
        generation, results = self.scorer.score(generation, records, f"step{step}")
        return records, generation, results

    def start(self, step: int) -> None:
        """Nothing to set up: generation happens on these ranks, when a step asks."""

    def policy_updated(self, version: int, timer: PhaseTimer) -> None:
        """The actor's weights changed: the next generation syncs first."""
        self.generator.policy_updated()

    def add_metrics(self, stats: SumsAndCounts) -> None:
        self.generator.add_metrics(stats)

    def abandon(self, exit_code: int) -> None:
        """Nothing to tell: every rank of the job runs the Trainer."""

    def close(self, exit_code: int = 0) -> None:
        """Stop the reward workers, the environments' sandbox and the engine."""
        self.scorer.close()
        if self.episodes is not None:
            self.episodes.close()
        self.generator.engine.close()

    def greedy_scores(self, rollout: Rollout, step: int) -> torch.Tensor:
        """Score of the greedy response to each prompt (ReMax's baseline)."""
        sampling = dataclasses.replace(self.config.rollout.sampling, n=1, temperature=0.0,
                                       stop_token_ids=self.data.stop_token_ids)
        generation = self._generate(rollout.records, rollout.token_ids, sampling)
        _, results = self.scorer.score(generation, rollout.records, f"step{step}")
        return torch.tensor([result.score for result in results], dtype=torch.float32)

    def _generate(self, records: list, token_ids: list, sampling: SamplingConfig,
                  timer: PhaseTimer | None = None):
        """One response per prompt, or one episode per prompt and sample (multi-turn)."""
        if self.episodes is None:
            return self.generator.generate(token_ids, sampling, timer)
        return self.generator.run_episodes(self.episodes, records, sampling, timer)

    def state_dict(self) -> dict:
        """This rank's part of the checkpoint."""
        return {"pending_rollout": self.pending}

    def load_state_dict(self, state: dict) -> None:
        self.pending = state["pending_rollout"]

    def _one_step_ahead(self, step: int, timer: PhaseTimer) -> Rollout:
        if self.pending is None:
            self.pending = self.rollout(*self.data.next_batch(), step, timer)
        current = self.pending
        self.pending = self.rollout(*self.data.next_batch(), step, timer, round_index=1)
        return current

    def _varied_groups(self, step: int, timer: PhaseTimer, stats: SumsAndCounts) -> Rollout:
        """Rounds until every rank has `wanted` varied groups or rollout.max_sampling_rounds is
        reached; then every rank trains on as many as the poorest has, cut to whole
        micro-batches, falling back to the unfiltered first round when none."""
        wanted = self.config.rollout.prompts_per_step // self.data.dp_size
        rounds, kept = [], []
        for round_index in range(self.config.rollout.max_sampling_rounds):
            rounds.append(self.rollout(*self.data.next_batch(), step, timer, round_index))
            kept.append(varied_groups(rounds[-1]))
            fewest = self._fewest_over_data_parallel(sum(map(len, kept)))
            if fewest >= wanted:
                break
        unit = self._group_unit()
        usable = min(wanted, fewest) // unit * unit
        stats.add("rollout/sampling_rounds", torch.tensor([float(len(rounds))]))
        stats.add("rollout/varied_group_fraction", torch.tensor(
            [sum(map(len, kept)) / (len(rounds) * wanted)]))
        if usable == 0:
            print0("dynamic sampling: no rank found enough groups with varied rewards; "
                   "training on the unfiltered first round")
            return rounds[0]
        trimmed, remaining = [], usable
        for prompt_indices in kept:
            trimmed.append(prompt_indices[:remaining])
            remaining -= len(trimmed[-1])
        return select_groups(rounds, trimmed)

    def _fewest_over_data_parallel(self, count: int) -> int:
        holder = torch.tensor([count], dtype=torch.int64,
                              device=collective_device(self.dp_group))
        dist.all_reduce(holder, op=dist.ReduceOp.MIN, group=self.dp_group)
        return int(holder.item())

    def _group_unit(self) -> int:
        """Smallest number of prompts whose responses cut into the configured mini- and
        micro-batches."""
        config = self.config
        micro_batch = _rows_per_micro_batch(config, "actor")
        if config.algorithm.needs_critic:
            micro_batch = math.lcm(micro_batch, _rows_per_micro_batch(config, "critic"))
        rows_unit = config.trainer.mini_batches * micro_batch
        return rows_unit // math.gcd(rows_unit, config.rollout.sampling.n)


def training_sampling(config: JobConfig, stop_token_ids: tuple[int, ...], step: int,
                      round_index: int = 0) -> SamplingConfig:
    """Training sampling with the stop tokens and a seed fixed by the step and round."""
    return dataclasses.replace(config.rollout.sampling, stop_token_ids=stop_token_ids,
                               seed=(config.runtime.seed * 100_003 + step) * 101 + round_index)


def evaluation_sampling(config: JobConfig, stop_token_ids: tuple[int, ...]) -> SamplingConfig:
    """Evaluation sampling with the stop tokens and the run's seed (every evaluation samples
    alike)."""
    return dataclasses.replace(config.rollout.eval_sampling, stop_token_ids=stop_token_ids,
                               seed=config.runtime.seed)


def _rows_per_micro_batch(config: JobConfig, role: str) -> int:
    """The row count a role's micro-batches need (any count with a token budget)."""
    return 1 if config.micro_batch_tokens(role) else getattr(config, role).micro_batch_size

"""The rollout engine as the RL step uses it: it always generates with the actor's current
weights, and holds device memory only while it generates.

The order is the GPU's: the engine's weights are woken and written (the resharder's sync), the
roles configured with `offload` park their device memory in host memory, the KV cache returns,
the engine generates, and everything goes back. A sync is skipped when the engine already holds
the actor's weights (an evaluation right before the next step's rollout, on an engine whose
weights survive sleep).
"""

from __future__ import annotations

import contextlib

from mcore_rl.agents.instance import run_on_instance
from mcore_rl.config.rollout import PromptConfig, SamplingConfig
from mcore_rl.observability.step_metrics import PhaseTimer, SumsAndCounts
from mcore_rl.rollout import Generation, RolloutEngine
from mcore_rl.training.offload import HostParking

from .shard_parts import ShardParts
from .weight_sync import WeightSync


class PolicyGenerator:
    """Generation with the actor's current weights (phases 'switch', 'reshard', 'generate')."""

    def __init__(self, engine: RolloutEngine, weight_sync: WeightSync | None, actor,
                 parkings: list[HostParking], prompt_config: PromptConfig, shard_group):
        self.engine = engine
        self.shard_parts = ShardParts(engine, shard_group)
        """The data shard's prompts are generated once, in parts over its engine instances."""
        self.weight_sync = weight_sync
        """Feeds the engine the actor's weights; None when it generates on the actor's own
        parameters."""
        self.actor = actor
        self.parkings = parkings
        """Host-memory parking of the roles with `offload` set, used while generating."""
        self.prompt_config = prompt_config
        self.weights_current = False
        """Whether the engine holds the actor's current weights (no update since the sync)."""

    def generate(self, token_ids: list[list[int]], sampling: SamplingConfig,
                 timer: PhaseTimer | None = None) -> Generation:
        timer = timer or PhaseTimer()
        with self.awake(timer), timer("generate"):
            first, mine = self.shard_parts.mine(token_ids)
            part = self.engine.generate(mine, sampling, self.prompt_config, first)
            return self.shard_parts.joined(part, len(token_ids))

    def run_episodes(self, runner, records: list, sampling: SamplingConfig,
                     timer: PhaseTimer | None = None) -> Generation:
        """Multi-turn episodes for `records` (agents.EpisodeRunner or AgentRunner) on the
        engine."""
        timer = timer or PhaseTimer()
        with self.awake(timer), timer("generate"):
            part = run_on_instance(runner, self.engine, self.shard_parts.mine(records)[1],
                                   sampling, self.prompt_config.max_prompt_tokens)
            return self.shard_parts.joined(part, len(records))

    def policy_updated(self) -> None:
        """The actor's weights changed: the next generation syncs first."""
        self.weights_current = False

    @contextlib.contextmanager
    def uncounted(self):
        """Syncs made meanwhile (an evaluation's) stay out of the next step's reshard/*
        metrics, which then describe the step's own generation alone (a resumed run's step
        repeats them whether or not an evaluation came before it)."""
        before = list(self.weight_sync.since_last_step) if self.weight_sync else []
        try:
            yield
        finally:
            if self.weight_sync is not None:
                self.weight_sync.since_last_step = before

    def add_metrics(self, stats: SumsAndCounts) -> None:
        """The weight syncs' bytes and memory since the last call."""
        if self.weight_sync is not None:
            self.weight_sync.add_metrics(stats)

    @contextlib.contextmanager
    def awake(self, timer: PhaseTimer | None = None):
        """The engine holds its weights and KV cache only meanwhile, with the actor's current
        weights."""
        timer = timer or PhaseTimer()
        with timer("switch"):
            self.engine.wake_weights()
        with timer("reshard"):
            self._sync_weights()
        with timer("switch"):
            for parking in self.parkings:
                parking.park()
            self.engine.wake()
        try:
            yield
        finally:
            with timer("switch"):
                self.engine.sleep()
                self.weights_current &= self.engine.weights_survive_sleep
                for parking in self.parkings:
                    parking.restore()

    def _sync_weights(self) -> None:
        if self.weight_sync is not None and not self.weights_current:
            self.weight_sync.sync(self.actor.parameters_for_sync())
        self.weights_current = True

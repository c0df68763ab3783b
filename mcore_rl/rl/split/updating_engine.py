"""The engine as a rollout rank's multi-turn episodes drive it: weights land while they run.

A batch of episodes can run for many engine steps and tool calls; holding the trainers' next
update until the whole batch ends would stall them (rollout.max_staleness >= 1 exists to
overlap the two). So every rollout.update_check_steps engine iterations the episode loop asks
for the trainers' control messages, and new weights are loaded between two engine steps,
whatever the episodes are doing: sampling a turn, or waiting for their environment. Nothing is
aborted: a turn in flight goes on with the new weights (each token keeps the log-prob it was
sampled with, and the stretches record which version sampled which tokens), as single-turn
partial rollouts do; with rollout.partial_rollout=abort the turn is asked again from its start
instead (the episode's earlier turns and its environment's state stay as they are: an
environment cannot be rewound).

Every rank of the rollout side counts the same engine iterations (the episode loops agree on
each step: vLLM's data-parallel agreement, and the instance leader's messages to the other
ranks of a tensor-parallel instance), so all of them check at the same iteration, which keeps
the check's collectives in step.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from mcore_rl.rollout import FinishedSample, RolloutEngine, SampleRequest

from .book import apply_update


@dataclasses.dataclass
class _Turn:
    key: str
    """The key the episode asked for it under."""

    request: SampleRequest
    """As the engine runs it (another key once restarted)."""

    versions: list[tuple[int, int]]
    attempt: int = 0


class UpdatingEngine:
    """A RolloutEngine for an EpisodeRunner (see the module docstring)."""

    def __init__(self, engine: RolloutEngine, version: int,
                 take_weights: Callable[[], Optional[int]], check_every: int, restart: bool):
        """take_weights: load the trainers' new weights if they sent any (collective over the
        rollout ranks); returns their version, or None. restart: partial_rollout=abort."""
        self.engine = engine
        self.instance_group, self.shard_key = engine.instance_group, engine.shard_key
        self.version = version
        self.take_weights = take_weights
        self.check_every = check_every
        self.restart = restart
        self.restarts = 0
        """Turns asked again at an update."""
        self._iterations = 0
        self._turns: dict[str, _Turn] = {}
        """The turns in flight, by engine key."""

    def add_requests(self, requests: list[SampleRequest]) -> None:
        for request in requests:
            self._turns[request.key] = _Turn(request.key, request, [(0, self.version)])
        self.engine.add_requests(requests)

    def has_unfinished(self, local_work: bool = False) -> bool:
        self._iterations += 1
        if self._iterations % self.check_every == 0:
            version = self.take_weights()
            if version is not None:
                self._weights_changed(version)
        return self.engine.has_unfinished(local_work)

    def step(self) -> list[FinishedSample]:
        finished = []
        for sample in self.engine.step():
            turn = self._turns.pop(sample.key)
            finished.append(dataclasses.replace(sample, key=turn.key,
                                                versions=tuple(turn.versions)))
        return finished

    def _weights_changed(self, version: int) -> None:
        aborted, again = apply_update(self._turns, list(self._turns),
                                      self.engine.generated_lengths(), version, self.restart)
        self.restarts += len(again)
        self.engine.abort(aborted)
        self.engine.add_requests([turn.request for turn in again])
        self.version = version

"""The trainer's entry point to rule-based rewards: check the dataset's data sources at start-up,
score batches of responses in the sandbox, log every failure with its sample id.

    with RuleRewards(config.reward) as rewards:
        rewards.check_data_sources(dataset_data_sources)       # before the first rollout
        results = rewards.score(requests)                        # list[RewardResult], in order

Everything that can be wrong with the configuration (a dotted path that does not import, a
reward_fn that cannot be pickled, a data_source nobody scores) raises ValueError here, before
any work; what goes wrong inside a reward call only zeroes that sample's reward (`probe` runs
the functions once on real rows, so that what the sandbox refuses them stops a job at start).
"""

from __future__ import annotations

import logging
from typing import Iterable, Optional, Sequence

from mcore_rl.config.reward import RewardConfig

from .registry import FunctionTable, load_function
from ..sandbox import SandboxLimits
from ..sandbox.user_code import pickle_by_value
from .worker_pool import WorkerPool
from .scoring import Scorer
from .types import RewardFunction, RewardRequest, RewardResult
from .unscored import UNREWARDED_EPISODE

logger = logging.getLogger("mcore_rl.rewards")


class RuleRewards:
    """Rule-based rewards by data_source, computed in worker processes with a timeout.

    `reward_fn`, when given, scores every data source (verl's compute_score signature); it
    reaches the worker processes by cloudpickle (a function of the script, a lambda or a
    closure by value), so what it holds must pickle.
    Not thread-safe: one score() at a time.
    """

    def __init__(self, config: RewardConfig, reward_fn: Optional[RewardFunction] = None):
        errors = config.errors()
        if errors:
            raise ValueError("invalid reward config: " + "; ".join(errors))
        self.config = config
        self._table = FunctionTable.from_config(config)
        self._reward_fn = reward_fn
        if reward_fn is None:
            self._check_configured_paths()
        elif config.num_workers > 0:
            _check_picklable(reward_fn)
        self._scorer = Scorer(self._table, reward_fn, config.format_weight,
                              config.format_pattern)
        self._checked_sources: set[str] = set()
        self._pool = (WorkerPool(self._scorer, config.num_workers, config.timeout_seconds,
                                 config.startup_timeout_seconds, _worker_limits(config))
                      if config.num_workers > 0 else None)
        self._closed = False

    def check_data_sources(self, data_sources: Iterable[str]) -> None:
        """ValueError (UnknownDataSourceError) naming every data_source no function scores and
        listing the known ones; call it on the dataset before the first rollout."""
        if self._reward_fn is not None:
            return
        new_sources = set(data_sources) - self._checked_sources
        self._table.check_data_sources(new_sources)
        self._checked_sources |= new_sources

    def score(self, requests: Sequence[RewardRequest]) -> list[RewardResult]:
        """One result per request, in order. A function that raises, times out, crashes its
        worker or returns a non-number gives score 0 and an error, logged with the sample id;
        only an unknown data_source raises (before any call)."""
        if self._closed:
            raise RuntimeError("RuleRewards.score() after close()")
        self.check_data_sources({request.data_source for request in requests})
        if self._pool is not None:
            results = self._pool.score(requests)
        else:
            results = [self._scorer.score(request) for request in requests]
        for request, result in zip(requests, results):
            if result.error is not None:
                logger.error("reward 0 for sample %s (data_source %r): %s", request.sample_id,
                             request.data_source, result.error)
        return results

    def probe(self, requests: Sequence[RewardRequest]) -> None:
        """Score `requests` (real rows, before any rollout) and raise ValueError naming each that
        failed, its error and the sandbox setting that would allow it: a function that cannot
        read its files, see its variables or import within the memory limit stops the job at
        start, not one sample at a time. Rows only an environment's get_reward scores are
        skipped."""
        requests = [request for request in requests if self._reward_fn is not None
                    or self._table.path_for(request.data_source) != UNREWARDED_EPISODE]
        failed = [f"{request.sample_id} (data_source {request.data_source!r}): {result.error}"
                  for request, result in zip(requests, self.score(requests)) if result.error]
        if failed:
            raise ValueError("the reward function failed on a real row before the first step "
                             "(each data source's function scores its first row, with the "
                             f"row's ground truth as the response): {'; '.join(failed)}")

    def live_workers(self) -> int:
        """Worker processes alive now (0 when scoring inline)."""
        return self._pool.live_workers() if self._pool is not None else 0

    def worker_pids(self) -> list[int]:
        return self._pool.worker_pids() if self._pool is not None else []

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        self._closed = True
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> "RuleRewards":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _check_configured_paths(self) -> None:
        """Import every configured function here, so a typo fails before any worker runs it."""
        for data_source, path in self.config.functions.items():
            load_function(path, f"data_source {data_source!r} (reward.functions)")
        if self.config.default_function is not None:
            load_function(self.config.default_function, "reward.default_function")


def _worker_limits(config: RewardConfig) -> SandboxLimits:
    """One worker's confinement: CPU time bounded like wall time (the longer of a load's and a
    call's)."""
    return SandboxLimits(
        timeout_seconds=config.timeout_seconds, memory_mb=config.memory_mb,
        cpu_seconds=max(config.timeout_seconds, config.startup_timeout_seconds),
        network=config.network, environment=tuple(config.environment),
        readable=tuple(config.readable), allow_unconfined=config.allow_unconfined)


def _check_picklable(reward_fn: RewardFunction) -> None:
    try:
        pickle_by_value(reward_fn, f"reward_fn {reward_fn!r}")
    except ValueError as error:
        raise ValueError(f"{error}; or set reward.num_workers=0 to score inline") from error

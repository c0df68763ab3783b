"""Reward workers: sandboxed sessions that run reward functions with a per-call timeout.

A reward function is user code run on model output: it may raise, hang, spin forever, or be
steered by what the model wrote (a parser that evaluates, a regex that explodes). None of that
may stop training or reach the machine, so each worker is a session of the sandbox
(mcore_rl.sandbox, the same confinement as the agents' tools): forked from one zygote the rank
starts, no network (unless reward.network), writes only beneath its own directory, none of the
rank's environment, rlimits, and replies the rank decodes as plain data only (worker_session.py).

The pool hands each idle worker the next request, so one slow call holds up only its own
worker. A worker loads a data source's function on first use (bounded by
startup_timeout_seconds, not counted in the call's timeout), then scores (timeout_seconds). A
call past its deadline cannot be cancelled inside Python (`while True: pass` ignores
everything), so the session is killed and a fresh one opened in its place. Workers die with the
rank: the zygote has the rank's death signal and kills its sessions.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Optional, Sequence

from ..sandbox import Reply, Sandbox, SandboxLimits
from ..sandbox.errors import describe_exception, setting_hint
from .scoring import Scorer
from .types import RewardRequest, RewardResult
from .worker_session import LOAD, SCORE

SESSION = "mcore_rl.rewards.worker_session:RewardSession"
POLL_SECONDS = 60.0
"""Longest one wait for replies (a deadline that passes sooner ends it sooner)."""


@dataclass
class _Worker:
    """One session and the replies it still owes, in order."""

    key: str
    opening: bool = True
    failure: str = ""
    """Why the session could not open (the error of the work queued behind that)."""

    loaded: set = field(default_factory=set)
    """Data sources whose function the session has loaded."""

    owed: deque = field(default_factory=deque)
    """(LOAD or SCORE, request index, data source) per reply still to come."""

    ended: bool = False


class WorkerPool:
    """`num_workers` long-lived sandboxed sessions scoring batches of requests with timeouts."""

    def __init__(self, scorer: Scorer, num_workers: int, timeout_seconds: float,
                 startup_timeout_seconds: float, limits: SandboxLimits):
        if num_workers < 1:
            raise ValueError(f"a worker pool needs at least one worker, not {num_workers}")
        self.timeout_seconds = timeout_seconds
        self.startup_timeout_seconds = startup_timeout_seconds
        self._scorer = scorer
        self._sandbox = Sandbox(limits, name="rewards",
                                preload=(SESSION.partition(":")[0], *scorer.user_modules()))
        self._keys = (f"worker{serial}" for serial in itertools.count())
        self._workers = [self._open() for _ in range(num_workers)]
        self._by_key = {worker.key: worker for worker in self._workers}
        self._closed = False
        self._await_opened(strict=True)

    def score(self, requests: Sequence[RewardRequest]) -> list[RewardResult]:
        """Results in request order; timeouts and crashes become score-0 results."""
        if self._closed:
            raise RuntimeError("the reward worker pool is closed")
        results: list[Optional[RewardResult]] = [None] * len(requests)
        pending = deque(range(len(requests)))
        while pending or any(worker.owed for worker in self._workers):
            self._replace_ended()
            for worker in self._workers:
                if not worker.owed and pending:
                    self._assign(worker, pending.popleft(), requests, results)
            self._receive(results)
        self._replace_ended()
        self._await_opened(strict=False)
        return results

    def live_workers(self) -> int:
        """Worker processes alive now (opened, not ended)."""
        return len(self.worker_pids())

    def worker_pids(self) -> list[int]:
        pids = self._sandbox.pids()
        return [pids[worker.key] for worker in self._workers
                if worker.key in pids and not worker.ended]

    def close(self) -> None:
        """Stop every worker (idempotent)."""
        self._closed = True
        self._sandbox.shutdown()

    def _await_opened(self, strict: bool) -> None:
        """Wait until every session has opened (its pid is known). strict (at start-up): a
        session that cannot open is an error, before any work; else it is replaced at the next
        score()."""
        while any(worker.opening for worker in self._workers):
            for reply in self._sandbox.poll(timeout=POLL_SECONDS):
                if strict and not reply.ok:
                    self.close()
                    raise RuntimeError(f"a reward worker cannot start: {reply.error}")
                self._record_open(self._by_key[reply.key], reply)

    def _record_open(self, worker: _Worker, reply: Reply) -> None:
        worker.opening, worker.failure = False, "" if reply.ok else reply.error
        worker.ended |= reply.ended

    def _replace_ended(self) -> None:
        """Open a fresh session in place of each that ended (the sandbox answered every request
        it still owed in the batch that ended it)."""
        for slot, worker in enumerate(self._workers):
            if worker.ended:
                del self._by_key[worker.key]
                self._workers[slot] = fresh = self._open()
                self._by_key[fresh.key] = fresh

    def _open(self) -> _Worker:
        worker = _Worker(next(self._keys))
        self._sandbox.open(worker.key, SESSION, self._scorer,
                           timeout_seconds=self.startup_timeout_seconds)
        return worker

    def _assign(self, worker: _Worker, index: int, requests: Sequence[RewardRequest],
                results: list[Optional[RewardResult]]) -> None:
        """Send request `index` to `worker`, after the load of its data source's function
        where the session has not loaded it yet; a request that cannot be pickled is a failed
        result."""
        request = requests[index]
        try:
            ForkingPickler.dumps(request)
        except Exception as error:
            results[index] = RewardResult.failed(
                f"request cannot be sent to a reward worker: {describe_exception(error)}")
            return
        if request.data_source not in worker.loaded:
            self._sandbox.send(worker.key, (LOAD, request.data_source),
                               timeout_seconds=self.startup_timeout_seconds)
            worker.owed.append((LOAD, index, request.data_source))
        self._sandbox.send(worker.key, (SCORE, request), timeout_seconds=self.timeout_seconds)
        worker.owed.append((SCORE, index, request.data_source))

    def _receive(self, results: list[Optional[RewardResult]]) -> None:
        """Wait for replies (or a deadline) and record them."""
        for reply in self._sandbox.poll(timeout=POLL_SECONDS):
            worker = self._by_key[reply.key]
            if worker.opening:
                self._record_open(worker, reply)
                continue
            worker.ended |= reply.ended
            kind, index, data_source = worker.owed.popleft()
            if kind == LOAD and reply.ok:
                worker.loaded.add(data_source)
            elif results[index] is None:  # else a failed load answered for the request
                results[index] = self._result(kind, reply, worker.failure)

    def _result(self, kind: str, reply: Reply, failure: str) -> RewardResult:
        """A reply as a RewardResult: a score's plain data, checked, or the error in words,
        each error with the reward.* setting that would allow it where one fits."""
        if reply.ok:
            result = _decode(reply.value)
            return result if result.error is None else dataclasses.replace(
                result, error=_with_hint(result.error, setting_hint(result.error, "reward")))
        error = reply.error
        if failure and error == "session ended":
            error = f"the reward worker could not start: {failure}"
        elif error.startswith("session process died"):
            error = "reward worker" + error[len("session"):]
        elif kind == LOAD and error.startswith("timeout after"):
            return RewardResult.failed(f"{error} starting the reward worker or loading the "
                                       "reward function (reward.startup_timeout_seconds bounds it)")
        return RewardResult.failed(_with_hint(error, setting_hint(error, "reward")))


def _with_hint(error: str, hint: str) -> str:
    return f"{error} ({hint})" if hint else error


def _decode(value) -> RewardResult:
    """The result a worker sent ({"score", "error", "details"}), or a failed one when it is not
    shaped so (the reward function shares the worker's process and could forge it)."""
    if (isinstance(value, dict) and set(value) == {"score", "error", "details"}
            and isinstance(value["score"], float)
            and isinstance(value["error"], (str, type(None)))
            and isinstance(value["details"], dict)
            and all(isinstance(name, str) and isinstance(number, float)
                    for name, number in value["details"].items())):
        return RewardResult(value["score"], value["error"], value["details"])
    return RewardResult.failed(f"the reward worker sent a malformed result {value!r:.200}")

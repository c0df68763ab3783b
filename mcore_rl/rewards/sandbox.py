"""Worker processes that run reward functions with a per-call timeout.

A reward function is user code run on model output: it may raise, hang, or spin forever, and
none of that may stop training. Each worker is a `spawn`ed process (the trainer is a
torch.distributed rank with threads and maybe CUDA state, so it must not fork) holding one end
of a pipe; the pool hands each idle worker the next request, so one slow call holds up only its
own worker. A call past its deadline cannot be cancelled inside Python (`while True: pass`
ignores everything), so its worker is killed and a fresh one takes its place.

Per request the worker says "started" once it has imported and prepared the data_source's
function (first use only; bounded by startup_timeout_seconds), then runs the call (bounded by
timeout_seconds), then sends the RewardResult. A worker whose parent dies (a killed job) exits by
itself within ORPHAN_CHECK_SECONDS, even in the middle of a call.

Spawned workers re-import the parent's `__main__` module unless it is a package's __main__.py
(as with `python -m mcore_rl`): scripts that create a pool need an `if __name__ == "__main__":`
guard, and what they import at top level is imported again by every worker.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
from typing import Optional, Sequence

from .scoring import Scorer
from .types import RewardRequest, RewardResult, describe_exception

STARTED = "started"
DONE = "done"
# How long a stopping worker gets to exit by itself before it is killed.
STOP_GRACE_SECONDS = 2.0
ORPHAN_CHECK_SECONDS = 1.0


def serve(connection: Connection, scorer: Scorer) -> None:
    """A worker's loop: a request in, "started", the result out; None or a closed pipe ends it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the trainer, which stops us
    threading.Thread(target=exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    while True:
        try:
            request = connection.recv()
        except EOFError:
            return
        if request is None:
            return
        try:
            function = scorer.function_for(request.data_source)
        except Exception as error:
            connection.send((DONE, RewardResult.failed(describe_exception(error))))
            continue
        connection.send((STARTED, None))
        connection.send((DONE, scorer.call(function, request)))


def exit_when_orphaned(parent_pid: int) -> None:
    """Exit once the parent is gone (killed mid-call: the pipe's EOF is never read while a
    function spins), polling every ORPHAN_CHECK_SECONDS."""
    while os.getppid() == parent_pid:
        time.sleep(ORPHAN_CHECK_SECONDS)
    os._exit(1)


@dataclass
class Worker:
    """One worker process and the request it is busy with."""

    process: BaseProcess
    connection: Connection
    index: Optional[int] = None
    """Position of the request being scored in the current batch (None: idle)."""

    started: bool = False
    """The call itself is running (before: the worker is starting or loading the function)."""

    deadline: float = math.inf
    """time.monotonic() by which the current phase must end."""

    def assign(self, index: int, deadline: float) -> None:
        self.index, self.started, self.deadline = index, False, deadline

    def release(self) -> None:
        self.index, self.started, self.deadline = None, False, math.inf


class WorkerPool:
    """`num_workers` long-lived worker processes scoring batches of requests with timeouts."""

    def __init__(self, scorer: Scorer, num_workers: int, timeout_seconds: float,
                 startup_timeout_seconds: float):
        if num_workers < 1:
            raise ValueError(f"a worker pool needs at least one worker, not {num_workers}")
        self.timeout_seconds = timeout_seconds
        self.startup_timeout_seconds = startup_timeout_seconds
        self._scorer = scorer
        self._context = multiprocessing.get_context("spawn")
        self._workers: list[Worker] = []
        # Stops the workers when the pool is garbage-collected or the interpreter exits.
        self._finalizer = weakref.finalize(self, stop_workers, self._workers)
        self._workers.extend(self._start_worker() for _ in range(num_workers))

    def score(self, requests: Sequence[RewardRequest]) -> list[RewardResult]:
        """Results in request order; timeouts and crashes become score-0 results."""
        if not self._finalizer.alive:
            raise RuntimeError("the reward worker pool is closed")
        results: list[Optional[RewardResult]] = [None] * len(requests)
        pending = deque(range(len(requests)))
        while pending or self._busy():
            for slot, worker in enumerate(self._workers):
                if worker.index is None and pending:
                    self._assign(slot, pending.popleft(), requests, results)
            self._receive(results)
            self._expire(results)
        return results

    def live_workers(self) -> int:
        """Worker processes currently alive."""
        return sum(worker.process.is_alive() for worker in self._workers)

    def worker_pids(self) -> list[int]:
        return [worker.process.pid for worker in self._workers]

    def close(self) -> None:
        """Stop every worker (idempotent)."""
        self._finalizer()

    def _start_worker(self) -> Worker:
        parent_end, child_end = self._context.Pipe()
        process = self._context.Process(target=serve, args=(child_end, self._scorer),
                                        name="mcore_rl-reward-worker", daemon=True)
        process.start()
        child_end.close()
        return Worker(process, parent_end)

    def _replace(self, slot: int) -> None:
        stop_workers([self._workers[slot]], grace_seconds=0.0)
        self._workers[slot] = self._start_worker()

    def _busy(self) -> list[Worker]:
        return [worker for worker in self._workers if worker.index is not None]

    def _assign(self, slot: int, index: int, requests: Sequence[RewardRequest],
                results: list[Optional[RewardResult]]) -> None:
        """Send request `index` to the worker in `slot` (replacing the worker if it died); a
        request that cannot be pickled is a failed result."""
        try:
            message = ForkingPickler.dumps(requests[index])
        except Exception as error:
            results[index] = RewardResult.failed(
                f"request cannot be sent to a reward worker: {describe_exception(error)}")
            return
        try:
            self._workers[slot].connection.send_bytes(message)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            self._replace(slot)
            self._workers[slot].connection.send_bytes(message)
        self._workers[slot].assign(index, time.monotonic() + self.startup_timeout_seconds)

    def _receive(self, results: list[Optional[RewardResult]]) -> None:
        """Wait until a message arrives or the nearest deadline passes; handle what arrived."""
        busy = self._busy()
        if not busy:
            return
        remaining = min(worker.deadline for worker in busy) - time.monotonic()
        ready = wait([worker.connection for worker in busy], timeout=max(0.0, remaining))
        for slot, worker in enumerate(self._workers):
            if worker.connection not in ready:
                continue
            try:
                kind, result = worker.connection.recv()
            except (EOFError, ConnectionResetError):
                worker.process.join(timeout=STOP_GRACE_SECONDS)
                results[worker.index] = RewardResult.failed(
                    f"reward worker process died (exit code {worker.process.exitcode})")
                self._replace(slot)
                continue
            if kind == STARTED:
                worker.started = True
                worker.deadline = time.monotonic() + self.timeout_seconds
            else:
                results[worker.index] = result
                worker.release()

    def _expire(self, results: list[Optional[RewardResult]]) -> None:
        """Kill and replace the workers whose current phase ran past its deadline."""
        now = time.monotonic()
        for slot, worker in enumerate(self._workers):
            if worker.index is None or now < worker.deadline:
                continue
            if worker.started:
                error = f"timeout after {self.timeout_seconds} s"
            else:
                error = (f"timeout after {self.startup_timeout_seconds} s starting the reward "
                         "worker or loading the reward function")
            results[worker.index] = RewardResult.failed(error)
            self._replace(slot)


def stop_workers(workers: list[Worker], grace_seconds: float = STOP_GRACE_SECONDS) -> None:
    """Ask idle workers to exit, kill whatever is still running after `grace_seconds`."""
    for worker in workers:
        if worker.index is None and grace_seconds > 0:
            try:
                worker.connection.send(None)
            except (BrokenPipeError, ConnectionResetError, OSError):
                pass
    deadline = time.monotonic() + grace_seconds
    for worker in workers:
        worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join()
        worker.connection.close()

"""Where a job's start-up seconds go: one clock, from the launcher to the first step.

Why this exists: start-up is paid by every run (and by every requeue), and it is spread over
code that knows nothing of the rest: the launcher's job check, the interpreter and its imports,
the process groups, the model build and weight load, the reference copy, the engine start. A
number for each, printed once by rank 0 and logged with the first step (`startup/<phase>`,
seconds, in metrics.jsonl), says which to cut and shows a regression where it happens.

    from mcore_rl.observability.startup import STARTUP
    with STARTUP.phase("model_build"):       # consecutive, not nested
        ...
    STARTUP.report()                          # rank 0 prints the table (once)

There is one clock per process (`STARTUP`): every phase is an interval on it. The time between
phases is `other`, so the phases always add up to the total. The clock starts when the launcher
started (`MCORE_RL_LAUNCHED_AT`, epoch seconds, exported by scripts/torchrun.sh, which also
exports how long its job check took as `MCORE_RL_LAUNCH_CHECK_SECONDS`), else when this process
started (Linux's /proc), else when this module was imported.

Imports only the standard library: the package imports it before anything heavy.
"""

from __future__ import annotations

import contextlib
import os
import time

LAUNCHED_AT_ENV = "MCORE_RL_LAUNCHED_AT"
"""Epoch seconds at which the launcher (scripts/torchrun.sh) started."""
LAUNCH_CHECK_ENV = "MCORE_RL_LAUNCH_CHECK_SECONDS"
"""Seconds the launcher's one-time job check took (part of `launcher`)."""

METRIC_PREFIX = "startup/"
MAX_LAUNCHER_SECONDS = 3600.0


def process_started_at() -> float | None:
    """Epoch seconds at which this process started (Linux: /proc, to 10 ms), else None."""
    try:
        with open("/proc/self/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as handle:
            uptime = float(handle.read().split()[0])
        started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (uptime - started_after_boot)


class StartupClock:
    """Consecutive named intervals from the launch to the first step (see the module)."""

    def __init__(self, environ=None, now: float | None = None):
        environ = os.environ if environ is None else environ
        now = time.time() if now is None else now
        process = process_started_at()
        self.process_started = process if process is not None else now
        try:
            launched = float(environ[LAUNCHED_AT_ENV])
        except (KeyError, ValueError):
            launched = None
        # A launcher time after this process started, or long before it, belongs to another
        # launch (a variable inherited from an outer job): then the process start is the origin.
        self.started = launched if launched is not None and \
            self.process_started - MAX_LAUNCHER_SECONDS <= launched \
            <= self.process_started + 0.05 else self.process_started
        self.seconds: dict[str, float] = {}
        """Phase -> seconds, in the order the phases first ran."""
        if self.started < self.process_started:
            check = _float(environ.get(LAUNCH_CHECK_ENV))
            launcher = self.process_started - self.started
            if check is not None and 0 <= check <= launcher:
                self.seconds["launch_check"] = check
                launcher -= check
            self.seconds["launcher"] = launcher
        self._cursor = self.process_started
        self._open: str | None = None
        self._reported = False
        self.finished: float | None = None
        """Epoch seconds at the end of start-up (the first step's start), once known."""

    def lap(self, name: str, now: float | None = None) -> float:
        """Count the time since the last phase ended as `name` (its seconds)."""
        now = time.time() if now is None else now
        spent = max(0.0, now - self._cursor)
        self.seconds[name] = self.seconds.get(name, 0.0) + spent
        self._cursor = max(self._cursor, now)
        return spent

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time the block as `name` (the gap since the previous phase is `other`). A phase
        inside another one counts in the outer one only."""
        if self._open is not None:
            yield
            return
        self.lap("other")
        self._open = name
        try:
            yield
        finally:
            self._open = None
            self.lap(name)

    def total(self) -> float:
        return sum(self.seconds.values())

    def metrics(self) -> dict[str, float]:
        """`startup/<phase>` seconds and `startup/total`."""
        metrics = {METRIC_PREFIX + name: value for name, value in self.seconds.items()}
        metrics[METRIC_PREFIX + "total"] = self.total()
        return metrics

    def table(self) -> str:
        total = self.total()
        rows = [f"start-up {total:.1f} s (launch -> first step):"]
        for name, value in sorted(self.seconds.items(), key=lambda item: -item[1]):
            share = 100 * value / total if total else 0.0
            rows.append(f"  {name:<22} {value:6.2f} s  {share:4.0f}%")
        return "\n".join(rows)

    def report(self, rank: int = 0) -> None:
        """Print the table once, on rank 0 (the phases so far; `other` up to now)."""
        self.lap("other")
        if rank == 0 and not self._reported:
            print(self.table(), flush=True)
        self._reported = True

    def first_step_metrics(self, step_seconds: float, now: float | None = None
                           ) -> dict[str, float]:
        """The metrics logged with the first step: the phases, plus `until_first_step` (from
        the report to the step's start: e.g. the step-0 evaluation), once; {} afterwards."""
        if self.finished is not None:
            return {}
        now = time.time() if now is None else now
        self.finished = now - step_seconds
        self.lap("until_first_step", self.finished)
        return self.metrics()


def _float(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


class FirstStepLogger:
    """A metrics logger that adds the start-up phases to the first training step's row (the
    rest is the wrapped logger's)."""

    def __init__(self, logger, clock: StartupClock):
        self._logger, self._clock = logger, clock

    def log(self, step: int, metrics: dict, prefix: str = "step") -> None:
        if prefix == "step" and self._clock.finished is None and "time/step" in metrics:
            metrics = {**metrics, **self._clock.first_step_metrics(metrics["time/step"])}
        self._logger.log(step, metrics, prefix)

    def __getattr__(self, name: str):
        return getattr(self._logger, name)


STARTUP = StartupClock()
"""This process's clock (started at import: the package imports this module early)."""

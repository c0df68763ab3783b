"""The start-up clock (observability.startup): phases that add up to the launch-to-first-step
total, logged once with the first step; and the launch check running torchrun in its process."""

import os
import time

from mcore_rl.launch_check import main as launch_check_main
from mcore_rl.observability.startup import (LAUNCH_CHECK_ENV, LAUNCHED_AT_ENV, FirstStepLogger,
                                            StartupClock, process_started_at)


def test_this_process_start_is_read_from_proc():
    started = process_started_at()
    assert started is not None and started <= time.time()
    assert time.time() - started < 24 * 3600


def test_phases_add_up_to_the_total_from_the_launch():
    process = process_started_at()
    clock = StartupClock({LAUNCHED_AT_ENV: repr(process - 3.0), LAUNCH_CHECK_ENV: "2.0"})
    assert clock.seconds["launch_check"] == 2.0
    assert abs(clock.seconds["launcher"] - 1.0) < 0.05
    clock.lap("imports")
    with clock.phase("engine_start"):
        with clock.phase("inner"):  # counted in the outer phase only
            time.sleep(0.01)
    assert "inner" not in clock.seconds and clock.seconds["engine_start"] >= 0.01
    now = time.time()
    metrics = clock.first_step_metrics(step_seconds=0.0, now=now)
    assert abs(metrics["startup/total"] - (now - (process - 3.0))) < 0.05
    assert abs(sum(value for name, value in metrics.items() if name != "startup/total")
               - metrics["startup/total"]) < 1e-6
    assert clock.first_step_metrics(0.0) == {}  # once


def test_a_launch_time_from_another_launch_is_ignored():
    later = StartupClock({LAUNCHED_AT_ENV: repr(time.time() + 100)})
    assert "launcher" not in later.seconds and later.started == later.process_started
    unreadable = StartupClock({LAUNCHED_AT_ENV: "not a time"})
    assert unreadable.started == unreadable.process_started


def test_the_first_step_row_carries_the_startup_phases():
    rows = []

    class Logger:
        closed = False

        def log(self, step, metrics, prefix="step"):
            rows.append((step, prefix, metrics))

    logger = FirstStepLogger(Logger(), StartupClock({}))
    logger.log(0, {"eval/accuracy": 0.5}, "eval")
    logger.log(1, {"time/step": 0.5})
    logger.log(2, {"time/step": 0.5})
    assert "startup/total" not in rows[0][2] and "startup/total" in rows[1][2]
    assert rows[1][2]["startup/until_first_step"] >= 0 and "startup/total" not in rows[2][2]
    assert logger.closed is False  # the rest is the wrapped logger's


def test_the_launch_check_refuses_before_torchrun_starts(capsys, monkeypatch):
    """`--torchrun ARGS`: a refused job never reaches torchrun (status 2, one line)."""
    import torch.distributed.run

    monkeypatch.setattr(torch.distributed.run, "main", lambda args: (_ for _ in ()).throw(
        AssertionError("torchrun started")))
    status = launch_check_main(["--as", "torchrun.sh", "1", "1", "1", "train", "--config",
                                "configs/grpo_toy.yaml", "trainer.total_stepz=2", "--torchrun",
                                "--nnodes", "1", "-m", "mcore_rl", "train"])
    assert status == 2
    assert capsys.readouterr().err.startswith("torchrun.sh: error: ")


def test_the_launch_check_then_runs_torchrun_with_its_arguments(monkeypatch):
    import torch.distributed.run

    seen = []
    monkeypatch.setattr(torch.distributed.run, "main", seen.append)
    monkeypatch.delenv(LAUNCH_CHECK_ENV, raising=False)
    status = launch_check_main(["--as", "torchrun.sh", "1", "1", "1", "plan", "--model", "x",
                                "--torchrun", "--nnodes", "1", "-m", "mcore_rl", "plan"])
    assert status == 0 and seen == [["--nnodes", "1", "-m", "mcore_rl", "plan"]]
    assert float(os.environ[LAUNCH_CHECK_ENV]) >= 0

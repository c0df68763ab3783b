"""The harness every multi-process test stands on (`world.py`): a rank's failure fails its test
with the rank's traceback, a hung world ends by its timeout with no rank left behind, and a rank
sees its test's environment and writes where the test reads, and what each rank returns comes
back by rank; a failed world leaves no file."""

import os
import tempfile
import time

import pytest

from world import run_world


def _fail_on_rank_one(marker: str) -> None:
    if int(os.environ["RANK"]) == 1:
        raise ValueError(f"rank 1 failed on purpose ({marker})")


def _hang(pid_folder: str) -> None:
    open(os.path.join(pid_folder, str(os.getpid())), "w").close()
    time.sleep(3600)


def _report(variable: str) -> tuple[int, str | None]:
    print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} sees "
          f"{variable}={os.environ.get(variable)} in {os.getcwd()}", flush=True)
    return int(os.environ["RANK"]), os.environ.get(variable)


def test_a_failing_rank_fails_the_test_with_its_traceback(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where torch puts the tracebacks
    with pytest.raises(Exception) as raised:
        run_world(2, _fail_on_rank_one, "marker-4711")
    assert "rank 1 failed on purpose (marker-4711)" in str(raised.value)
    assert "_fail_on_rank_one" in str(raised.value)  # the rank's traceback, not only its message
    assert list(tmp_path.glob("pytorch-errorfile-*")) == []  # the file that carried it is gone


def test_a_hung_world_ends_by_its_timeout_and_leaves_no_rank(tmp_path):
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="_hang did not finish in 10 s"):
        run_world(2, _hang, str(tmp_path), timeout=10)
    assert time.monotonic() - started < 40
    pids = [int(name) for name in os.listdir(tmp_path)]
    assert len(pids) == 2
    assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}")]


def test_a_rank_sees_the_tests_environment_and_writes_where_the_test_reads(
        tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("MCORE_RL_WORLD_PROBE", "set-by-the-test")
    monkeypatch.chdir(tmp_path)
    returned = run_world(2, _report, "MCORE_RL_WORLD_PROBE")
    assert returned == [(0, "set-by-the-test"), (1, "set-by-the-test")]  # by rank
    out = capfd.readouterr().out
    for rank in (0, 1):
        assert f"rank {rank} of 2 sees MCORE_RL_WORLD_PROBE=set-by-the-test in {tmp_path}" in out

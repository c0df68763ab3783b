"""Helper processes of a rank (a multiprocessing Manager: what Megatron's torch_dist checkpoint
writer starts in every rank) die of a SIGUSR1 meant for the rank (SLURM's --signal reaches every
process) and outlive the rank when it is SIGKILLed, unless they were started inside
runtime.process_guard.helper_processes_guarded."""

import contextlib
import json
import multiprocessing
import os
import signal
import time

import psutil
import pytest

from mcore_rl.runtime.process_guard import helper_processes_guarded

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs Linux pidfds")


def _new_child(known: set) -> int:
    (pid,) = {child.pid for child in multiprocessing.active_children()} - known
    known.add(pid)
    return pid


def start_managers_and_die(guarded: bool, out_file: str) -> None:
    """Handle SIGUSR1 (as the trainer does its save signal), start two Managers, send the first
    SIGUSR1 and try to use it, then die of SIGKILL."""
    signal.signal(signal.SIGUSR1, lambda *_: None)
    context, pids = multiprocessing.get_context("spawn"), set()
    with helper_processes_guarded() if guarded else contextlib.nullcontext():
        signalled = context.Manager()
        signalled_pid = _new_child(pids)
        other = context.Manager()  # noqa: F841 (alive until the SIGKILL)
        _new_child(pids)
    os.kill(signalled_pid, signal.SIGUSR1)
    time.sleep(0.5)
    try:
        signalled.Queue().put(1)
        survived_signal = True
    except ConnectionError:
        survived_signal = False
    with open(out_file, "w") as handle:
        json.dump({"survived_signal": survived_signal, "pids": sorted(pids)}, handle)
    os.kill(os.getpid(), signal.SIGKILL)


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("guarded", [False, True])
def test_helpers_survive_the_ranks_signals_and_die_with_the_rank_only_when_guarded(tmp_path,
                                                                                   guarded):
    out_file = str(tmp_path / "managers.json")
    owner = multiprocessing.get_context("spawn").Process(target=start_managers_and_die,
                                                         args=(guarded, out_file))
    owner.start()
    owner.join(timeout=120)
    assert owner.exitcode == -signal.SIGKILL
    with open(out_file) as handle:
        result = json.load(handle)
    deadline = time.monotonic() + 5
    while any(map(running, result["pids"])) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [pid for pid in result["pids"] if running(pid)]
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert result["survived_signal"] == guarded
    assert len(survivors) == (0 if guarded else 1)  # unguarded: the one not signalled

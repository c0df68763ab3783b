"""A SIGKILLed process's multiprocessing Manager (what Megatron's torch_dist checkpoint writer
starts in every rank) outlives it, unless runtime.process_guard's guard was handed it."""

import multiprocessing
import os
import signal
import time

import psutil
import pytest

from mcore_rl.runtime.process_guard import guard_helper_processes

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs Linux pidfds")


def start_manager_and_die(guarded: bool, pid_file: str) -> None:
    manager = multiprocessing.get_context("spawn").Manager()
    manager.Queue()
    if guarded:
        guard_helper_processes()
    with open(pid_file, "w") as handle:
        handle.write(str(multiprocessing.active_children()[0].pid))
    os.kill(os.getpid(), signal.SIGKILL)


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("guarded", [False, True])
def test_a_killed_process_helpers_end_only_when_guarded(tmp_path, guarded):
    pid_file = str(tmp_path / "manager.pid")
    owner = multiprocessing.get_context("spawn").Process(target=start_manager_and_die,
                                                         args=(guarded, pid_file))
    owner.start()
    owner.join(timeout=120)
    assert owner.exitcode == -signal.SIGKILL
    with open(pid_file) as handle:
        manager = int(handle.read())
    deadline = time.monotonic() + 5
    while running(manager) and time.monotonic() < deadline:
        time.sleep(0.1)
    survived = running(manager)
    if survived:
        os.kill(manager, signal.SIGKILL)
    assert survived == (not guarded)

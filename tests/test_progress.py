"""Progress bars: a real tqdm bar only on global rank 0 when enabled, a silent stand-in with the
same interface everywhere else, and correct counts."""

import io

import pytest

from mcore_rl.runtime.progress import ENV_VAR, NullProgress, progress, progress_enabled


class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    """Rank 0 of a world of one, with MCORE_RL_PROGRESS unset."""
    for name in (ENV_VAR, "RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)


def test_enabled_on_a_terminal_only_unless_forced(monkeypatch):
    assert progress_enabled(Terminal())
    assert not progress_enabled(io.StringIO())
    monkeypatch.setenv(ENV_VAR, "1")
    assert progress_enabled(io.StringIO())
    monkeypatch.setenv(ENV_VAR, "0")
    assert not progress_enabled(Terminal())


def test_other_ranks_never_draw(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = Terminal()
    assert not progress_enabled(out)
    bar = progress(range(3), desc="x", file=out)
    assert isinstance(bar, NullProgress)
    assert list(bar) == [0, 1, 2] and bar.n == 3 and bar.total == 3
    with progress(total=5, desc="x", file=out) as manual:
        manual.update(2)
        manual.set_postfix(loss=1.0)
        manual.set_description("y")
    assert manual.n == 2
    assert out.getvalue() == ""


def test_disabled_is_a_silent_stand_in():
    out = io.StringIO()  # not a terminal, variable unset
    with progress(["a", "b"], file=out) as bar:
        assert isinstance(bar, NullProgress)
        assert list(bar) == ["a", "b"]
    assert out.getvalue() == ""


def test_enabled_bar_counts_iterations_and_updates(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    out = io.StringIO()
    bar = progress(range(4), desc="load", unit="tensor", file=out, mininterval=0)
    assert not isinstance(bar, NullProgress)
    assert list(bar) == [0, 1, 2, 3]
    bar.close()
    assert bar.n == 4
    assert "load" in out.getvalue() and "4/4" in out.getvalue() and "tensor" in out.getvalue()

    out = io.StringIO()
    with progress(total=7, desc="write", unit="file", file=out, mininterval=0) as bar:
        bar.update(3)
        bar.update(4)
    assert bar.n == 7 and "7/7" in out.getvalue()


def test_vllm_factory_draws_only_the_engine_bar(monkeypatch, capsys):
    """vLLM calls use_tqdm(iterable, desc="Adding requests") and then
    use_tqdm(total=..., desc="Processed prompts", dynamic_ncols=True, postfix=...)."""
    from mcore_rl.rollout.vllm_start import vllm_progress

    monkeypatch.setenv(ENV_VAR, "1")
    prompts = [[1], [2]]
    assert vllm_progress(prompts, desc="Adding requests") is prompts
    bar = vllm_progress(total=2, desc="Processed prompts", dynamic_ncols=True,
                         postfix="est. speed input: 0.00 toks/s", mininterval=0)
    bar.update(2)
    assert bar.format_dict["elapsed"] >= 0  # what vLLM reads for its throughput postfix
    bar.close()
    assert "2/2" in capsys.readouterr().err

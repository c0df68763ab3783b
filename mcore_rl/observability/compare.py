"""`mcore-rl compare RUN_DIR ...`: an A/B table of runs, one row each, and a comparison plot.

Why these columns: they answer "which run learned more, for how much drift and compute" at a
glance; everything else is in the per-run plots and TensorBoard. How each is computed:

    steps           the last logged step
    final reward    mean of reward/mean over the last FINAL_WINDOW logged steps (one step's
                    batch is noisy; fewer steps when the run has fewer)
    max KL          max of actor/kl_to_reference over all steps; "-" without a reference model
    final accuracy  eval/accuracy of the last evaluation; "-" without evaluations
    tokens/s        mean of throughput/tokens_per_second over all steps
    wall time (s)   sum of time/step over all steps: time spent training. Not last - first
                    wall_time, which would count evaluations, checkpoint saves, start-up and the
                    time a killed run was down before it resumed.

nan values (a bad step's metrics) are left out of means and maxima; a column with no value is
"-".
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Sequence

from .run_files import Run, load_run

FINAL_WINDOW = 5
"""Steps averaged for "final reward"."""

COLUMNS = ("run", "steps", "final reward", "max KL", "final accuracy", "tokens/s",
           "wall time (s)")


@dataclasses.dataclass
class RunSummary:
    """One row of the comparison table (None: the run did not log it)."""

    name: str
    """The run directory as given."""
    steps: int | None
    """Last logged step."""
    final_reward: float | None
    """Mean reward/mean over the last FINAL_WINDOW steps."""
    max_kl: float | None
    """Max actor/kl_to_reference."""
    final_accuracy: float | None
    """Last eval/accuracy."""
    tokens_per_second: float | None
    """Mean throughput/tokens_per_second."""
    wall_time: float | None
    """Sum of time/step, seconds."""


def _without_nan(values: Sequence[float]) -> list[float]:
    return [value for value in values if not math.isnan(value)]


def _mean(values: Sequence[float]) -> float | None:
    values = _without_nan(values)
    return sum(values) / len(values) if values else None


def summarize(run: Run) -> RunSummary:
    """The table row of one run."""
    rewards = run.series("reward/mean")[1]
    kl = _without_nan(run.series("actor/kl_to_reference")[1])
    accuracy = _without_nan(run.series("eval/accuracy")[1])
    step_seconds = _without_nan(run.series("time/step")[1])
    return RunSummary(
        name=run.name,
        steps=run.metrics[-1]["step"] if run.metrics else None,
        final_reward=_mean(rewards[-FINAL_WINDOW:]),
        max_kl=max(kl) if kl else None,
        final_accuracy=accuracy[-1] if accuracy else None,
        tokens_per_second=_mean(run.series("throughput/tokens_per_second")[1]),
        wall_time=sum(step_seconds) if step_seconds else None)


def _cell(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(summaries: Sequence[RunSummary]) -> str:
    """The table as aligned text: a header line, then one line per run."""
    rows = [list(COLUMNS)] + [
        [summary.name, _cell(summary.steps, "d"), _cell(summary.final_reward, ".4f"),
         _cell(summary.max_kl, ".4g"), _cell(summary.final_accuracy, ".4f"),
         _cell(summary.tokens_per_second, ".1f"), _cell(summary.wall_time, ".1f")]
        for summary in summaries]
    widths = [max(len(row[column]) for row in rows) for column in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(cell.ljust(width) if column == 0 else cell.rjust(width)
                  for column, (cell, width) in enumerate(zip(row, widths))).rstrip()
        for row in rows)


def compare_command(run_dirs: Sequence[str], output: str = "compare.png") -> str:
    """`mcore-rl compare`: print the table of the runs and write the comparison plot to
    `output`. Returns the table."""
    from .plots import plot_comparison

    runs = [load_run(run_dir) for run_dir in run_dirs]
    table = format_table([summarize(run) for run in runs])
    print(table)
    plot_comparison(runs, output)
    print(f"wrote {os.path.abspath(output)}")
    return table

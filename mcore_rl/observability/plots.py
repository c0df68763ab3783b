"""PNG plots of one run (`mcore-rl plot RUN_DIR`, `plot_run`) and of several (`mcore-rl compare`).

Why: a run's learning curves should be one file away on a cluster without a TensorBoard server
or a browser. Why this way:
- matplotlib's object API on an Agg canvas, not pyplot: no global figure state, no display
  needed, nothing changes for a caller that uses pyplot itself. Imported only here, when a plot
  is drawn, so importing the evaluation package (the trainer does) stays cheap.
- Each PNG is written under a temporary name in the same folder and renamed over the final one,
  so a reader (or a plot taken while training runs) never sees a half-written file.
- Plots read the run directory's JSON lines (run_files.py), so they work on a finished run, a
  running one and a killed one alike.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Sequence

from .run_files import PLOTS_DIR, Run, load_run
from .timeline import read_timeline

TIMELINE_STEPS = 3
"""Steps the timeline plot shows (the run's last)."""


def _figure(columns: int = 1):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4 * columns, 4.0), layout="constrained")
    FigureCanvasAgg(figure)
    return figure, [figure.add_subplot(1, columns, column + 1) for column in range(columns)]


def save_png_atomically(figure, path: str | os.PathLike) -> Path:
    """Write `figure` as PNG to `path` via a temporary file in the same folder and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        figure.savefig(temporary, format="png", dpi=100)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path


def _line(axes, run: Run, name: str, label: str, **style) -> bool:
    """Plot `name` over steps if the run logged it; whether it did."""
    if not run.has(name):
        return False
    steps, values = run.series(name)
    values = [value if math.isfinite(value) else math.nan for value in values]  # gaps
    marker = "o" if name.startswith("eval/") else None
    axes.plot(steps, values, label=label, marker=marker, markersize=3, **style)
    return True


def _finish(axes, title: str, ylabel: str) -> None:
    axes.set_title(title)
    axes.set_xlabel("step")
    axes.set_ylabel(ylabel)
    axes.grid(alpha=0.3)
    if axes.get_legend_handles_labels()[0]:
        axes.legend()
    else:
        axes.text(0.5, 0.5, "not logged", ha="center", va="center", transform=axes.transAxes)


def _reward_plot(run: Run, path: Path) -> Path:
    figure, (axes,) = _figure()
    if _line(axes, run, "reward/mean", "train reward/mean") and run.has("reward/std"):
        rows = [record for record in run.metrics
                if record.get("reward/mean") is not None and record.get("reward/std") is not None]
        mean = [record["reward/mean"] for record in rows]
        std = [record["reward/std"] for record in rows]
        axes.fill_between([record["step"] for record in rows],
                          [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                          alpha=0.2, label="train reward/mean ± reward/std")
    _line(axes, run, "eval/reward_mean", "eval/reward_mean")
    _line(axes, run, "eval/rm_score_mean", "eval/rm_score_mean (reward model)")
    _finish(axes, f"{run.name}: reward", "reward")
    return save_png_atomically(figure, path)


def _accuracy_plot(run: Run, path: Path) -> Path:
    figure, (axes,) = _figure()
    _line(axes, run, "reward/accuracy", "train reward/accuracy")
    _line(axes, run, "eval/accuracy", "eval/accuracy (pass@1)")
    pass_at_k = sorted({name for record in run.evals for name in record
                        if name.startswith("eval/pass@")})
    for name in pass_at_k:
        _line(axes, run, name, name)
    _finish(axes, f"{run.name}: accuracy (answers checked against the ground truth)",
            "fraction correct")
    return save_png_atomically(figure, path)


def _kl_plot(run: Run, path: Path) -> Path:
    figure, (axes,) = _figure()
    _line(axes, run, "actor/kl_to_reference", "train actor/kl_to_reference")
    _line(axes, run, "eval/kl_to_reference", "eval/kl_to_reference")
    _finish(axes, f"{run.name}: KL to the reference", "KL")
    return save_png_atomically(figure, path)


def plot_run(run_dir: str | os.PathLike) -> list[Path]:
    """Write RUN_DIR/plots/reward.png, accuracy.png, kl.png when a reference model logged the
    KL, and timeline.png when the run recorded its phases; return the paths written. Call on
    one rank (rank 0)."""
    run = load_run(run_dir)
    folder = run.directory / PLOTS_DIR
    written = [_reward_plot(run, folder / "reward.png"),
               _accuracy_plot(run, folder / "accuracy.png")]
    if run.has("actor/kl_to_reference") or run.has("eval/kl_to_reference"):
        written.append(_kl_plot(run, folder / "kl.png"))
    intervals = read_timeline(run.directory, TIMELINE_STEPS)
    if intervals:
        written.append(_timeline_plot(intervals, folder / "timeline.png"))
    return written


def _timeline_plot(intervals: list[dict], path: Path) -> Path:
    """One row per rank, a bar per phase, seconds from the first phase shown; dotted lines where
    a step's first phase starts. Gaps are time in no phase (waiting for other ranks)."""
    from matplotlib.patches import Patch

    figure, (axes,) = _figure()
    ranks = sorted({row["rank"] for row in intervals})
    figure.set_size_inches(12.8, 1.5 + 0.4 * len(ranks))
    origin = min(row["start"] for row in intervals)
    phases = sorted({row["phase"] for row in intervals})
    colors = {phase: f"C{index % 10}" for index, phase in enumerate(phases)}
    for row in intervals:
        axes.broken_barh([(row["start"] - origin, row["end"] - row["start"])],
                         (row["rank"] - 0.4, 0.8), color=colors[row["phase"]])
    steps = [row for row in intervals if row.get("side") != "rollout"]  # not versions held
    for step in sorted({row["step"] for row in steps}):
        begin = min(row["start"] for row in steps if row["step"] == step) - origin
        axes.axvline(begin, color="grey", linestyle=":", linewidth=0.8)
        axes.annotate(f"step {step}", (begin, 1.0), xycoords=("data", "axes fraction"),
                      fontsize=8, va="bottom")
    axes.set_yticks(ranks, [f"rank {rank}" for rank in ranks])
    axes.invert_yaxis()
    axes.set_xlabel("seconds")
    axes.legend(handles=[Patch(color=colors[phase], label=phase) for phase in phases],
                loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    axes.set_title(f"phases per rank, last {len({row['step'] for row in steps})} steps",
                   pad=14)
    return save_png_atomically(figure, path)


def plot_comparison(runs: Sequence[Run], output: str | os.PathLike) -> Path:
    """One PNG, two panels, one line per run: train reward/mean vs step, and eval/accuracy vs
    step (train reward/accuracy, dashed, for a run without evaluations)."""
    figure, (reward_axes, accuracy_axes) = _figure(columns=2)
    for index, run in enumerate(runs):
        color = f"C{index % 10}"
        _line(reward_axes, run, "reward/mean", run.name, color=color)
        if not _line(accuracy_axes, run, "eval/accuracy", run.name, color=color):
            _line(accuracy_axes, run, "reward/accuracy", f"{run.name} (train)", color=color,
                  linestyle="--")
    _finish(reward_axes, "train reward/mean", "reward")
    _finish(accuracy_axes, "eval/accuracy (pass@1)", "fraction correct")
    return save_png_atomically(figure, output)


def plot_command(run_dir: str) -> list[Path]:
    """`mcore-rl plot RUN_DIR`: write the run's plots and print their paths."""
    paths = plot_run(run_dir)
    for path in paths:
        print(f"wrote {path}")
    return paths

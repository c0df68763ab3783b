"""Step metrics: phase timers, means over the data-parallel ranks, console, JSONL, TensorBoard
and (optionally) Weights & Biases.

Every rank computes its local sums; one all-reduce over the data-parallel group turns them into
global means, so the numbers printed by rank 0 describe the whole batch, not rank 0's share.
wandb is an optional dependency: it is imported only when trainer.wandb_project is set, and the
config validation (TrainerConfig.errors) refuses that setting without the package before any
work starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time

import torch
import torch.distributed as dist

from mcore_rl.runtime.devices import collective_device
from mcore_rl.runtime.faults import kill_point

MACHINE_METRIC_PREFIXES = ("time/", "throughput/", "memory/", "startup/")
"""Metric names that measure the machine (seconds, rates, bytes), not the training: two runs of
the same job differ in them, so comparisons of runs (resume, placement, chaos) leave them out."""


class PhaseTimer:
    """Wall-clock seconds per named phase of one step (`with timer("generate"): ...`), and when
    each phase ran (for the run's timeline).

    exclusive: a phase opened inside another pauses it: the outer phase's interval so far is
    recorded when the inner one opens and it goes on when the inner one closes, so a rank's
    intervals never overlap (a weight update or a scoring pass between the engine steps of a
    running episode batch is not also counted as generating). `seconds` always counts each
    phase whole."""

    def __init__(self, exclusive: bool = False):
        self.exclusive = exclusive
        self.seconds: dict[str, float] = {}
        self.intervals: list[tuple[str, float, float]] = []
        """(phase, start, end) in Unix seconds, comparable between the ranks of a job."""
        self._open: list[list] = []
        """[phase, start of its running part (None while paused)] of the phases still open,
        outermost first."""

    @contextlib.contextmanager
    def __call__(self, phase: str):
        kill_point(phase)
        start, wall_start = time.perf_counter(), time.time()
        if self.exclusive and self._open:
            self._cut(self._open[-1], wall_start)
            self._open[-1][1] = None
        entry = [phase, wall_start]
        self._open.append(entry)
        try:
            yield
        finally:
            wall_end = time.time()
            self._open.remove(entry)
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start
            self._cut(entry, wall_end)
            if self.exclusive and self._open and self._open[-1][1] is None:
                self._open[-1][1] = wall_end  # the paused phase goes on

    def hand_over(self) -> list[tuple[str, float, float]]:
        """The intervals finished so far, which the timer then forgets (a timeline records
        them as one step). A phase still open is recorded when it closes, by a later hand-over
        (the part of an exclusive timer's paused phase before the pause is finished already).
        A timer replaced mid-phase instead would drop the whole open interval."""
        handed, self.intervals = self.intervals, []
        return handed

    def _cut(self, entry: list, end: float) -> None:
        if entry[1] is not None:
            self.intervals.append((entry[0], entry[1], end))

    def metrics(self) -> dict[str, float]:
        return {f"time/{phase}": seconds for phase, seconds in self.seconds.items()}


class SumsAndCounts:
    """Local sums, counts, maxima and minima, reduced over a process group in one call each."""

    def __init__(self):
        self.sums: dict[str, tuple[float, float]] = {}
        self.maxima: dict[str, float] = {}

    def add(self, name: str, values: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Accumulate a mean of `values` (where `mask` is 1) under `name`."""
        values = values.double()
        if mask is not None:
            mask = mask.bool()
            values = values[mask]
        total, count = self.sums.get(name, (0.0, 0.0))
        self.sums[name] = (total + float(values.sum()), count + values.numel())

    def add_ratio(self, name: str, numerator: float, denominator: float) -> None:
        """Accumulate a ratio of sums under `name` (its parts add up over calls and ranks:
        the result weighs each part by its denominator, not each rank alike)."""
        total, count = self.sums.get(name, (0.0, 0.0))
        self.sums[name] = (total + float(numerator), count + float(denominator))

    def add_max(self, name: str, values: torch.Tensor) -> None:
        """Accumulate a maximum under `name` (use -x for a minimum). The name is registered even
        for no values, so every rank reduces the same names: a rank without values holds -inf,
        which any value of another rank beats in the reduction, and a maximum over no values
        on any rank comes out as NaN (not a number that could be read as a measurement)."""
        largest = float(values.max()) if values.numel() else -math.inf
        self.maxima[name] = max(self.maxima.get(name, -math.inf), largest)

    def means(self) -> dict[str, float]:
        """This rank's means and maxima, without communication."""
        result = {name: total / max(count, 1) for name, (total, count) in self.sums.items()}
        result.update({name: _maximum(value) for name, value in self.maxima.items()})
        return result

    def reduce(self, group=None) -> dict[str, float]:
        """Global means and maxima (every rank must call it with the same names)."""
        names = sorted(self.sums)
        totals = torch.tensor([value for name in names for value in self.sums[name]],
                              dtype=torch.float64).reshape(-1)
        maxima = torch.tensor([self.maxima[name] for name in sorted(self.maxima)],
                              dtype=torch.float64)
        if dist.is_initialized():
            backend_device = collective_device(group)
            totals, maxima = totals.to(backend_device), maxima.to(backend_device)
            dist.all_reduce(totals, group=group)
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
        totals = totals.cpu().reshape(-1, 2)
        result = {name: float(totals[i, 0] / max(totals[i, 1], 1)) for i, name in enumerate(names)}
        result.update(zip(sorted(self.maxima), map(_maximum, maxima.cpu().tolist())))
        return result


def _maximum(value: float) -> float:
    """A reduced maximum: NaN for one over no values (-inf, add_max's empty mark)."""
    return math.nan if value == -math.inf else value


def peak_memory_metrics() -> dict[str, float]:
    """Peak accelerator memory of this rank, or its peak resident memory on CPU (MB)."""
    if torch.cuda.is_available():
        return {"memory/peak_allocated_mb": torch.cuda.max_memory_allocated() / 2 ** 20}
    from mcore_rl.runtime import peak_resident_mb
    return {"memory/peak_resident_mb": peak_resident_mb()}


def start_wandb(project: str, run_name: str | None, output_dir: str,
                run_config: dict | None = None):
    """A W&B run (rank 0) under output_dir/wandb; RuntimeError naming trainer.wandb_project
    and the pip command when wandb cannot be imported."""
    try:
        import wandb
    except ImportError as error:
        from mcore_rl.config.trainer import WANDB_MISSING
        raise RuntimeError(f"{WANDB_MISSING} ({error})") from error
    os.makedirs(output_dir, exist_ok=True)
    name = run_name or os.path.basename(os.path.normpath(os.path.abspath(output_dir)))
    return wandb.init(project=project, name=name, dir=output_dir, config=run_config)


class MetricsLogger:
    """Rank 0 prints a line per step and writes TensorBoard scalars, the run directory's JSONL
    files (metrics.jsonl per step, eval.jsonl per evaluation, read by `mcore-rl compare` and
    `mcore-rl plot`) and, with wandb_project, the same metrics to W&B; other ranks do
    nothing."""

    CONSOLE = ("reward/mean", "reward/accuracy", "actor/entropy", "actor/kl_to_reference",
               "actor/grad_norm", "critic/loss", "sft/loss", "sft/val_loss",
               "rm/loss", "rm/accuracy", "rm/val_loss", "rm/val_accuracy", "rm/val_margin",
               "dpo/loss", "dpo/rewards/accuracy", "dpo/val_loss", "dpo/val_rewards/accuracy",
               "dpo/val_rewards/margin",
               "response/length_mean", "time/step", "throughput/tokens_per_second")

    def __init__(self, output_dir: str, tensorboard: bool, wandb_project: str | None = None,
                 wandb_run_name: str | None = None, run_config: dict | None = None,
                 console_every: int = 1):
        """run_config: the job's config as a dict, recorded with the W&B run; console_every:
        print step 1's line and every console_every-th (evaluations always)."""
        self.active = not dist.is_initialized() or dist.get_rank() == 0
        self.console_every = console_every
        self.writer = None
        self.wandb_run = None
        self.jsonl = {}
        if self.active:
            from .run_files import EVAL_FILE, METRICS_FILE, JsonlWriter

            self.jsonl = {"step": JsonlWriter(os.path.join(output_dir, METRICS_FILE)),
                          "eval": JsonlWriter(os.path.join(output_dir, EVAL_FILE))}
        if self.active and tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(os.path.join(output_dir, "tensorboard"))
        if self.active and wandb_project:
            self.wandb_run = start_wandb(wandb_project, wandb_run_name, output_dir, run_config)

    @classmethod
    def for_job(cls, config) -> "MetricsLogger":
        """The logger a JobConfig asks for (runtime.output_dir, trainer.tensorboard,
        trainer.wandb_project / wandb_run_name, the config itself recorded with the W&B run,
        trainer.console_every)."""
        trainer = config.trainer
        return cls(config.runtime.output_dir, trainer.tensorboard, trainer.wandb_project,
                   trainer.wandb_run_name, dataclasses.asdict(config), trainer.console_every)

    def log(self, step: int, metrics: dict[str, float], prefix: str = "step") -> None:
        """prefix: 'step' (training metrics) or 'eval'."""
        if not self.active:
            return
        self.jsonl[prefix].write(step, metrics)
        if prefix == "eval" or step == 1 or step % self.console_every == 0:
            names = [name for name in self.CONSOLE if name in metrics] or sorted(metrics)
            shown = "  ".join(f"{name} {metrics[name]:.4g}" for name in names)
            print(f"{prefix} {step}: {shown}", flush=True)
        if self.writer is not None:
            for name, value in metrics.items():
                self.writer.add_scalar(name, value, step)
            self.writer.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(dict(metrics), step=step)

    def close(self) -> None:
        for writer in self.jsonl.values():
            writer.close()
        if self.writer is not None:
            self.writer.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()

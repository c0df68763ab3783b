"""Observability: what a run tells its user while it runs and afterwards.

While it runs (every trainer, RL or SFT): phase timers and data-parallel means of the step's
numbers (`step_metrics`), printed by rank 0 and written to metrics.jsonl and TensorBoard (and
Weights & Biases when configured). Afterwards: the readers of a run directory (`run_files`), its
plots (`plots`) and the A/B comparison table of `mcore-rl compare` (`compare`).

    metrics_log = JsonlWriter(os.path.join(output_dir, METRICS_FILE))   # rank 0
    metrics_log.write(step, step_metrics)
    plot_run(output_dir)                                                # rank 0, at the end

Nothing here imports torch.distributed or matplotlib at import time.
"""

from .compare import RunSummary, compare_command, format_table, summarize
from .plots import plot_command, plot_comparison, plot_run
from .run_files import (CONFIG_FILE, EVAL_FILE, METRICS_FILE, JsonlWriter, Run,
                        RunDirectoryError, load_run, read_jsonl, refuse_earlier_run)

__all__ = [
    "CONFIG_FILE", "EVAL_FILE", "JsonlWriter", "METRICS_FILE", "Run", "RunDirectoryError",
    "RunSummary", "compare_command", "format_table", "load_run", "plot_command",
    "plot_comparison", "plot_run", "read_jsonl", "refuse_earlier_run", "summarize",
]

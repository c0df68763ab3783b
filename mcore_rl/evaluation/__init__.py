"""Evaluation: metrics of generated responses, evaluators the trainer runs, and the readers of a
run directory (A/B comparison table, plots).

The trainer side (rank 0 writes, every rank evaluates):

    metrics_log = JsonlWriter(os.path.join(output_dir, METRICS_FILE))   # rank 0
    metrics_log.write(step, step_metrics)
    eval_metrics = run_evaluators(evaluators, trainer, samples)         # every rank, same result
    plot_run(output_dir)                                                # rank 0, at the end

The reader side: `mcore-rl compare RUN_DIR ...`, `mcore-rl plot RUN_DIR`, or `load_run(dir)`.
Nothing here imports torch.distributed or matplotlib at import time.
"""

from .compare import RunSummary, compare_command, format_table, summarize
from .evaluators import (AccuracyEvaluator, DiversityEvaluator, EvalSamples, Evaluator,
                         EvaluatorError, PassAtKEvaluator, ResponseLengthEvaluator,
                         RewardEvaluator, default_evaluators, run_evaluators)
from .metrics import (CORRECT_SCORE, distinct_n, is_correct, ngram_entropy, pass_at_k,
                      pass_at_k_one_prompt, repetition_rate)
from .plots import plot_command, plot_comparison, plot_run
from .run_files import (CONFIG_FILE, EVAL_FILE, METRICS_FILE, JsonlWriter, Run,
                        RunDirectoryError, load_run, read_jsonl)

__all__ = [
    "AccuracyEvaluator", "CONFIG_FILE", "CORRECT_SCORE", "DiversityEvaluator", "EVAL_FILE",
    "EvalSamples", "Evaluator", "EvaluatorError", "JsonlWriter", "METRICS_FILE",
    "PassAtKEvaluator", "ResponseLengthEvaluator", "RewardEvaluator", "Run",
    "RunDirectoryError", "RunSummary", "compare_command", "default_evaluators", "distinct_n",
    "format_table", "is_correct", "load_run", "ngram_entropy", "pass_at_k",
    "pass_at_k_one_prompt", "plot_command", "plot_comparison", "plot_run", "read_jsonl",
    "repetition_rate", "run_evaluators", "summarize",
]

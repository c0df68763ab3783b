"""Evaluation: metrics of generated responses and the evaluators a trainer runs on them (every
rank evaluates the samples of all ranks and gets the same result).

    eval_metrics = run_evaluators(evaluators, trainer, samples)

Writing and reading a run's files (metrics JSONL, plots, the A/B comparison table) is
observability's. Nothing here imports torch.distributed at import time.
"""

from .evaluators import (AccuracyEvaluator, DiversityEvaluator, EvalSamples, Evaluator,
                         EvaluatorError, PassAtKEvaluator, ResponseLengthEvaluator,
                         RewardEvaluator, default_evaluators, run_evaluators)
from .response_metrics import (CORRECT_SCORE, distinct_n, is_correct, ngram_entropy, pass_at_k,
                               pass_at_k_one_prompt, repetition_rate)

__all__ = [
    "AccuracyEvaluator", "CORRECT_SCORE", "DiversityEvaluator", "EvalSamples", "Evaluator",
    "EvaluatorError", "PassAtKEvaluator", "ResponseLengthEvaluator", "RewardEvaluator",
    "default_evaluators", "distinct_n", "is_correct", "ngram_entropy", "pass_at_k",
    "pass_at_k_one_prompt", "repetition_rate", "run_evaluators",
]

"""What the features a job turns on add to each RL step, declared once when the job is built.

The step (rl/trainer.py) reads the same whatever the job: it calls the terms added to the
estimator's advantages and the statistics kept of the completions that this module lists for
the job's config, and names no feature. A feature that adds to the step adds itself here: on-policy
distillation adds the teacher's advantage term, multi-turn agents their episodes' statistics.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

from mcore_rl.config import JobConfig
from mcore_rl.observability.step_metrics import SumsAndCounts

from .experience import add_distillation
from .step_statistics import episode_statistics

AdvantageTerm = Callable[[dict, SumsAndCounts], None]
"""(batch, stats): adds to batch["advantages"] after the estimator, and its figures to stats."""

CompletionStatistics = Callable[[list, SumsAndCounts], None]
"""(the step's completions, stats): adds figures of the completions (every rank adds every
name)."""


def advantage_terms(config: JobConfig) -> list[AdvantageTerm]:
    """The terms added to the estimator's advantages: the teacher's reverse KL when the job
    distils (teacher.init)."""
    return [partial(add_distillation, teacher=config.teacher)] if config.teacher.enabled else []


def completion_statistics(config: JobConfig) -> list[CompletionStatistics]:
    """The statistics kept of each batch's completions beyond the rollout's own: the episodes'
    when rollouts are multi-turn."""
    return [episode_statistics] if config.rollout.multi_turn.enabled else []

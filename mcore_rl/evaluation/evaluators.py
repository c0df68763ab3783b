"""Evaluators: what one evaluation measures, as small objects the trainer runs in a list.

    class MyEvaluator(Evaluator):
        def evaluate(self, trainer, samples):
            return {"answer_has_units": mean(has_units(r) for r in samples.responses)}

    trainer.register_evaluator(MyEvaluator())   # logged as eval/answer_has_units

Why this shape: it is the `evaluate(self, trainer)` hook users know from verl-style trainers,
plus the generated samples, so the common case (a number computed from the responses) needs no
generation of its own, while an evaluator that wants something else (its own prompts, the
trainer's models) can ignore `samples` and use `trainer`.

The trainer generates once per evaluation, gathers the samples from every data-parallel rank
(so every rank holds the same `EvalSamples`) and calls `run_evaluators` on every rank: the
built-ins are deterministic functions of the samples, so all ranks agree without communication.
The KL to the reference needs the models, so the trainer computes it itself.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Iterable

from . import response_metrics as metrics

EVAL_PREFIX = "eval/"
SCORED_BY = ("rule", "reward_model")


@dataclasses.dataclass
class EvalSamples:
    """What one evaluation generated, gathered over all data-parallel ranks (identical on every
    rank). Responses are grouped by prompt through `prompt_index`."""

    prompts: list[str]
    """The evaluated prompts' texts, one per prompt."""
    responses: list[str]
    """Every response's text."""
    response_token_ids: list[list[int]]
    """Every response's token ids (generated tokens only, stop token included if generated)."""
    scores: list[float]
    """Every response's reward: a rule's score, or a reward model's (see `scored_by`)."""
    prompt_index: list[int]
    """For every response, the index into `prompts` of the prompt it answers."""
    data_sources: list[str]
    """Every prompt's data source (dataset or task name), one per prompt like `prompts`."""
    samples_per_prompt: int
    """Responses generated per prompt (rollout.eval_sampling.n)."""
    scored_by: str = "rule"
    """"rule": `scores` are rule rewards and a response is correct when its score is at least
    metrics.CORRECT_SCORE. "reward_model": `scores` are a reward model's and say nothing about
    correctness; `checked` does."""
    checked: list[bool] | None = None
    """With scored_by="reward_model": per response, whether its answer matched the row's ground
    truth (the rule rewards' check), or None when the answers were not checked."""

    def __post_init__(self):
        responses = len(self.responses)
        for name in ("response_token_ids", "scores", "prompt_index"):
            if len(getattr(self, name)) != responses:
                raise ValueError(f"EvalSamples: {len(getattr(self, name))} {name} for "
                                 f"{responses} responses")
        if len(self.data_sources) != len(self.prompts):
            raise ValueError(f"EvalSamples: {len(self.data_sources)} data_sources for "
                             f"{len(self.prompts)} prompts")
        if any(not 0 <= index < len(self.prompts) for index in self.prompt_index):
            raise ValueError(f"EvalSamples: a prompt_index is outside 0..{len(self.prompts) - 1}")
        if self.samples_per_prompt < 1:
            raise ValueError(f"EvalSamples: samples_per_prompt={self.samples_per_prompt}")
        if self.scored_by not in SCORED_BY:
            raise ValueError(f"EvalSamples: scored_by={self.scored_by!r}, expected one of "
                             f"{', '.join(SCORED_BY)}")
        if self.checked is not None and (self.scored_by != "reward_model"
                                         or len(self.checked) != responses):
            raise ValueError(f"EvalSamples: checked ({len(self.checked)}) is for the "
                             f"{responses} responses of scored_by='reward_model'")

    def correct(self) -> list[bool] | None:
        """Whether each response is correct against its ground truth (rule scores at least
        metrics.CORRECT_SCORE, or the reward model's `checked`); None when unknown."""
        if self.scored_by == "rule":
            return [metrics.is_correct(score) for score in self.scores]
        return self.checked


class Evaluator:
    """Base class of evaluators. Subclasses implement `evaluate`; names without the "eval/"
    prefix get it when logged, and two evaluators may not return the same name."""

    def evaluate(self, trainer, samples: EvalSamples) -> dict[str, float]:
        """Metric name -> value (a float; nan allowed, inf not) for this evaluation. `trainer`
        is the calling Trainer; `samples` what it generated for the validation prompts."""
        raise NotImplementedError(f"{type(self).__name__}.evaluate")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


class RewardEvaluator(Evaluator):
    """The mean score of all responses: eval/reward_mean for rule rewards, eval/rm_score_mean
    for a reward model's (a reward, never to be read as accuracy)."""

    def evaluate(self, trainer, samples: EvalSamples) -> dict[str, float]:
        name = "eval/reward_mean" if samples.scored_by == "rule" else "eval/rm_score_mean"
        return {name: _mean([float(score) for score in samples.scores])}


class AccuracyEvaluator(Evaluator):
    """eval/accuracy: fraction of responses correct against their ground truth (pass@1); with
    several data sources also eval/accuracy/<source> for each. Nothing when the answers were
    not checked (a reward model without rules for the data)."""

    def evaluate(self, trainer, samples: EvalSamples) -> dict[str, float]:
        correct = samples.correct()
        if correct is None:
            return {}
        result = {"eval/accuracy": _mean([float(ok) for ok in correct])}
        if len(set(samples.data_sources)) > 1:
            for source in sorted(set(samples.data_sources)):
                result[f"eval/accuracy/{source}"] = _mean([
                    float(ok) for ok, prompt in zip(correct, samples.prompt_index)
                    if samples.data_sources[prompt] == source])
        return result


class PassAtKEvaluator(Evaluator):
    """eval/pass@K with K = samples_per_prompt, when K > 1 and answers are checked: the
    unbiased estimator of Chen et al. (2021) averaged over prompts (with exactly K samples per prompt it is the fraction of
    prompts with at least one correct response)."""

    def evaluate(self, trainer, samples: EvalSamples) -> dict[str, float]:
        k, correct = samples.samples_per_prompt, samples.correct()
        if k == 1 or correct is None:
            return {}
        num_samples, num_correct = metrics.counts_per_prompt(samples.prompt_index, correct)
        return {f"eval/pass@{k}": metrics.pass_at_k(num_samples, num_correct, k)}


class ResponseLengthEvaluator(Evaluator):
    """eval/response_length: mean number of generated tokens per response."""

    def evaluate(self, trainer, samples: EvalSamples) -> dict[str, float]:
        return {"eval/response_length": _mean([float(len(ids))
                                               for ids in samples.response_token_ids])}


class DiversityEvaluator(Evaluator):
    """eval/distinct_1, eval/distinct_2, eval/ngram_entropy (Ent-4, nats) and
    eval/repetition_rate (seq-rep-4) of the response token ids (see metrics.py)."""

    def evaluate(self, trainer, samples: EvalSamples) -> dict[str, float]:
        token_ids = samples.response_token_ids
        return {"eval/distinct_1": metrics.distinct_n(token_ids, 1),
                "eval/distinct_2": metrics.distinct_n(token_ids, 2),
                "eval/ngram_entropy": metrics.ngram_entropy(token_ids, metrics.ENTROPY_N),
                "eval/repetition_rate": metrics.repetition_rate(token_ids, metrics.REPETITION_N)}


def default_evaluators() -> list[Evaluator]:
    """The built-in evaluators, new instances: reward, accuracy, pass@k, length, diversity."""
    return [RewardEvaluator(), AccuracyEvaluator(), PassAtKEvaluator(),
            ResponseLengthEvaluator(), DiversityEvaluator()]


class EvaluatorError(ValueError):
    """An evaluator returned something that cannot be logged."""


def run_evaluators(evaluators: Iterable[Evaluator], trainer, samples: EvalSamples
                   ) -> dict[str, float]:
    """All evaluators' metrics in one dict, names prefixed with "eval/" where missing. Raises
    EvaluatorError (naming the evaluator class and the key) for a value that is not a real
    number or is infinite, and for a name two evaluators (or one, twice) return."""
    result: dict[str, float] = {}
    owner: dict[str, str] = {}
    for evaluator in evaluators:
        who = type(evaluator).__name__
        returned = evaluator.evaluate(trainer, samples)
        if not isinstance(returned, dict):
            raise EvaluatorError(f"{who}.evaluate returned {type(returned).__name__}, expected "
                                 "a dict of metric name -> float")
        for key, value in returned.items():
            if not isinstance(key, str) or not key:
                raise EvaluatorError(f"{who}.evaluate returned the key {key!r}, expected a "
                                     "non-empty str")
            name = key if key.startswith(EVAL_PREFIX) else EVAL_PREFIX + key
            if name in owner:
                raise EvaluatorError(f"{who} returned {key!r}, but {owner[name]} already "
                                     f"returned {name!r}: evaluator metric names must be unique")
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise EvaluatorError(f"{who} returned {key!r} = {value!r} of type "
                                     f"{type(value).__name__}, expected a float (use .item() "
                                     "for a tensor)")
            if math.isinf(value):
                raise EvaluatorError(f"{who} returned {key!r} = {value}: values must be finite "
                                     "(nan allowed for 'undefined')")
            owner[name] = who
            result[name] = float(value)
    return result

"""Evaluation metrics as pure functions of token ids and scores: diversity and pass@k.

Why pure Python on lists: an evaluation holds at most a few thousand responses, already gathered
to every rank, and the n-gram counts below are dictionary work that tensors would not speed up.
Keeping them free of torch and of process groups lets the tests compare each against a slow,
obvious reference, and lets users call them on their own outputs.

Conventions, chosen so that a degenerate evaluation never crashes and never yields a misleading
number:
- A response shorter than n tokens has no n-grams. It adds nothing to the pooled counts of
  `distinct_n` and `ngram_entropy`, and is left out of `repetition_rate`'s average.
- With no n-grams at all (every response empty or short) the diversity metrics are 0.0: a set of
  empty responses is the collapsed, least diverse output.
- Entropies are in nats (natural logarithm).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Iterable, Sequence

CORRECT_SCORE = 1.0
"""A response is correct when its score is at least this (the project's reward convention:
verifiable rewards give 1.0 for a right answer, format bonuses and penalties stay below it)."""

ENTROPY_N = 4
"""n of `eval/ngram_entropy`: Ent-4, the order Zhang et al. (2018) report."""

REPETITION_N = 4
"""n of `eval/repetition_rate`: seq-rep-4, the order Welleck et al. (2019) report."""


def is_correct(score: float) -> bool:
    """Whether a response with this score counts as correct (score >= CORRECT_SCORE)."""
    return score >= CORRECT_SCORE


def ngrams(token_ids: Sequence[int], n: int) -> list[tuple[int, ...]]:
    """The n-grams of one response in order (empty when it has fewer than n tokens)."""
    if n < 1:
        raise ValueError(f"n-gram order must be at least 1, got {n}")
    return [tuple(token_ids[i:i + n]) for i in range(len(token_ids) - n + 1)]


def _pooled_counts(responses: Iterable[Sequence[int]], n: int) -> Counter:
    counts: Counter = Counter()
    for token_ids in responses:
        counts.update(ngrams(token_ids, n))
    return counts


def distinct_n(responses: Iterable[Sequence[int]], n: int) -> float:
    """distinct-n (Li et al. 2016, "A Diversity-Promoting Objective Function for Neural
    Conversation Models"): distinct n-grams / all n-grams, pooled over all responses together.
    1.0 when no n-gram repeats anywhere; 0.0 when there are no n-grams."""
    counts = _pooled_counts(responses, n)
    total = sum(counts.values())
    return len(counts) / total if total else 0.0


def ngram_entropy(responses: Iterable[Sequence[int]], n: int = ENTROPY_N) -> float:
    """Ent-n (Zhang et al. 2018, "Generating Informative and Diverse Conversational Responses via
    Adversarial Information Maximization"): Shannon entropy, in nats, of the empirical frequency
    distribution of n-grams pooled over all responses, -sum_g p(g) log p(g). log(number of
    n-grams) when all differ; 0.0 when there are none or one kind."""
    counts = _pooled_counts(responses, n)
    total = sum(counts.values())
    return -sum(count / total * math.log(count / total) for count in counts.values()) \
        if total else 0.0


def repetition_rate(responses: Iterable[Sequence[int]], n: int = REPETITION_N) -> float:
    """seq-rep-n (Welleck et al. 2019, "Neural Text Generation with Unlikelihood Training"):
    per response, 1 - |unique n-grams| / |n-grams|, i.e. the fraction of its n-grams that repeat
    an earlier n-gram of the same response; averaged over the responses that have at least one
    n-gram (0.0 when none has)."""
    rates = []
    for token_ids in responses:
        grams = ngrams(token_ids, n)
        if grams:
            rates.append(1.0 - len(set(grams)) / len(grams))
    return sum(rates) / len(rates) if rates else 0.0


def pass_at_k_one_prompt(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k for one prompt (Chen et al. 2021, "Evaluating Large Language Models
    Trained on Code"): the probability that at least one of k samples drawn without replacement
    from the n generated is correct, 1 - C(n-c, k) / C(n, k). Exact: integer binomials, one
    correctly rounded division."""
    if not 0 <= num_correct <= num_samples:
        raise ValueError(f"pass@k: {num_correct} correct out of {num_samples} samples")
    if not 1 <= k <= num_samples:
        raise ValueError(f"pass@{k} needs 1 <= k <= samples per prompt ({num_samples})")
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def pass_at_k(num_samples: Sequence[int], num_correct: Sequence[int], k: int) -> float:
    """Unbiased pass@k averaged over prompts (prompt i: num_samples[i] generated,
    num_correct[i] of them correct). pass@1 is the mean accuracy when every prompt has the same
    number of samples. nan for no prompts."""
    if len(num_samples) != len(num_correct):
        raise ValueError(f"pass@k: {len(num_samples)} sample counts, {len(num_correct)} "
                         "correct counts")
    if not num_samples:
        return math.nan
    return sum(pass_at_k_one_prompt(n, c, k) for n, c in zip(num_samples, num_correct)) \
        / len(num_samples)


def counts_per_prompt(prompt_index: Sequence[int], correct: Sequence[bool]
                      ) -> tuple[list[int], list[int]]:
    """(samples, correct samples) per prompt, in order of first appearance, from the prompt
    each response answers and whether it is correct."""
    samples: dict[int, int] = {}
    correct_counts: dict[int, int] = {}
    for prompt, ok in zip(prompt_index, correct, strict=True):
        samples[prompt] = samples.get(prompt, 0) + 1
        correct_counts[prompt] = correct_counts.get(prompt, 0) + bool(ok)
    return list(samples.values()), [correct_counts[prompt] for prompt in samples]

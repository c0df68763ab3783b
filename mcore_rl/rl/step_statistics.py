"""The RL step's numbers: what each rank adds up from its rollouts, and what follows from the
data-parallel sums (standard deviations, the critic's explained variance)."""

from __future__ import annotations

import math

import torch

from mcore_rl.algorithms.kl import kl_estimate
from mcore_rl.algorithms.off_policy import importance_weights
from mcore_rl.config.rl import ImportanceCorrection
from mcore_rl.observability.step_metrics import SumsAndCounts
from mcore_rl.rollout.mismatch import add_logprob_mismatch

from .experience import Rollout, group_variation


def rollout_statistics(batch: dict, results: list, generation_metrics: dict,
                        stats: SumsAndCounts) -> None:
    """This rank's rollout numbers: rewards, lengths, advantages, values.
    reward/accuracy counts the answers checked against a ground truth (RewardResult.correct:
    every one or none, the same on every rank for a job)."""
    scores = batch["scores"].double()
    stats.add("reward/mean", scores)
    stats.add("reward/square", scores.square())
    _, varied = group_variation(scores, batch["group_ids"])
    if varied.numel():
        stats.add("reward/varied_group_fraction", varied.double())
    if results and results[0].correct is not None:
        stats.add("reward/accuracy", torch.tensor([float(r.correct) for r in results]))
    errors = sum(r.error is not None for r in results)
    stats.add("reward/errors", torch.tensor([errors], dtype=torch.float64))
    stats.add_ratio("reward/error_fraction", errors, len(results))
    response = batch["response_mask"].bool()
    lengths = response.sum(dim=1).double()
    stats.add("response/length_mean", lengths)
    stats.add_max("response/length_max", lengths)
    stats.add("response/truncated", batch["truncated"].double())
    stats.add("throughput/tokens", torch.tensor([float(batch["attention_mask"].sum())]))
    stats.add("advantages/mean", batch["advantages"], response)
    stats.add_max("advantages/max", batch["advantages"][response])
    stats.add_max("advantages/neg_min", -batch["advantages"][response])
    stats.add("rollout/truncated_prompts",
              torch.tensor([float(generation_metrics.get("truncated_prompts", 0))]))
    prefill_statistics(generation_metrics, len(results), stats)
    if "restarted_responses" in generation_metrics:  # split placement, the whole batch's
        stats.add_max("rollout/restarted_responses",
                      torch.tensor([float(generation_metrics["restarted_responses"])]))
    if "old_values" in batch:
        values, returns = batch["old_values"].double(), batch["returns"].double()
        stats.add("critic/values_mean", values, response)
        stats.add("critic/returns_mean", returns, response)
        stats.add("critic/returns_square", returns.square(), response)
        stats.add("critic/error_mean", returns - values, response)
        stats.add("critic/error_square", (returns - values).square(), response)


def prefill_statistics(generation_metrics: dict, samples: int, stats: SumsAndCounts) -> None:
    """rollout/prefix_cache_hit_rate: the prompt tokens the engine's prefix cache served over
    all the prompt tokens it was given (every turn's, in multi-turn episodes), over the batch;
    rollout/prefilled_tokens: the prompt tokens it computed, per sample (response or episode;
    with dynamic sampling the dropped groups' count too). A hit rate of 0 where nothing was
    counted."""
    prompt = generation_metrics.get("prompt_tokens", 0)
    cached = generation_metrics.get("cached_prompt_tokens", 0)
    stats.add_ratio("rollout/prefix_cache_hit_rate", cached, prompt)
    stats.add_ratio("rollout/prefilled_tokens", prompt - cached, samples)


EPISODE_COUNTS = ("turns", "tool_calls", "tool_errors", "tool_timeouts", "parse_failures",
                  "environment_failures", "template_mismatches", "observations_truncated",
                  "model_tokens", "observation_tokens", "truncated", "tool_seconds",
                  "history_rewrites", "agent_failures")
"""Per-episode counts logged as episode/<name> means (agents.episode.Episode.summary)."""


def episode_statistics(completions: list, stats: SumsAndCounts) -> None:
    """Multi-turn episodes' means per episode, episode/tool_use: the share of episodes with at
    least one tool call that worked, episode/multi_version: the share whose model turns more
    than one version of the weights sampled (split placement, an update landing while they
    ran), and episode/version_spread_max: the most versions between an episode's first and
    last sampled token (every rank adds every name, also with none)."""
    episodes = [completion.episode for completion in completions]
    for name in EPISODE_COUNTS:
        stats.add(f"episode/{name}", torch.tensor([float(e[name]) for e in episodes],
                                                  dtype=torch.float64))
    stats.add("episode/tool_use", torch.tensor(
        [float(e["tool_calls"] > e["tool_errors"]) for e in episodes], dtype=torch.float64))
    stats.add("episode/multi_version", torch.tensor(
        [float(len(c.versions) > 1) for c in completions], dtype=torch.float64))
    stats.add_max("episode/version_spread_max", torch.tensor(
        [float(c.versions[-1][1] - c.versions[0][1]) if c.versions else 0.0
         for c in completions], dtype=torch.float64))


def off_policy_statistics(batch: dict, rollout: Rollout, step: int,
                          stats: SumsAndCounts) -> None:
    """How far off-policy the batch is: policy versions between starting each response and
    training on it at `step`, the responses continued across a weight update (split
    placement's partial rollouts) and rollout/stale_token_fraction (response tokens sampled
    with weights older than version `step`: the rollout's, or where the engine recorded
    versions, each token's). Each token's version stays in the batch (`token_versions`) for
    `old_logprob_statistics`."""
    staleness = step - rollout.start_versions()
    stats.add("rollout/staleness_mean", staleness)
    stats.add_max("rollout/staleness_max", staleness)
    completions = rollout.generation.completions
    stats.add("rollout/continued_fraction", torch.tensor(
        [float(len(completion.versions) > 1) for completion in completions]))
    batch["token_versions"] = rollout.generation.token_versions(rollout.version)
    stats.add("rollout/stale_token_fraction",
              (batch["token_versions"] < step).double(), batch["response_mask"].bool())


def old_logprob_statistics(batch: dict, step: int, correction: ImportanceCorrection,
                           kl_estimator: str, stats: SumsAndCounts) -> None:
    """What the old log-probs show, once the batch has them (before the update, or from it:
    rollout.old_logprobs=update): the KL to the reference, and unless they are the engine's
    own (rollout.old_logprobs=engine) the engine/trainer log-prob mismatch,
    rollout/on_policy_logprob_abs_diff_max (the gap over the tokens the trained version itself
    sampled, which only numerics can open; the other tokens' gap is the policy's drift as
    well, as rollout/is_weight_* show; NaN in a step where it sampled none on any rank, never
    a 0 that would read as a perfect match) and the importance weights the actor's loss
    applies (with their masked fraction)."""
    response = batch["response_mask"].bool()
    old, engine = batch["old_logprobs"], batch["engine_logprobs"]
    if "ref_logprobs" in batch:
        kl = kl_estimate(old, batch["ref_logprobs"], kl_estimator)
        stats.add("actor/kl_to_reference", kl, response)
    if old is not engine:
        add_logprob_mismatch(stats, engine, old, response)
        current = response & (batch["token_versions"] == step)
        stats.add_max("rollout/on_policy_logprob_abs_diff_max",
                      (old.double() - engine.double()).abs()[current])
    if not correction.enabled:
        return
    mask = batch["loss_mask"].double()
    weights, keep = importance_weights(old.double(), engine.double(), mask, correction)
    stats.add("rollout/is_weight_mean", weights, mask * keep)
    stats.add_max("rollout/is_weight_max", weights[(mask * keep).bool()])
    stats.add("rollout/is_masked_fraction", 1 - keep, mask)


def derived_metrics(metrics: dict) -> dict:
    """Standard deviations, the advantage minimum, the critic's explained variance and the
    teacher's share of the advantage (its mean size over the sum of both parts' mean sizes)
    from the reduced sums (helper entries removed)."""
    metrics["reward/std"] = math.sqrt(max(metrics.pop("reward/square")
                                          - metrics["reward/mean"] ** 2, 0.0))
    metrics["advantages/min"] = -metrics.pop("advantages/neg_min")
    if "distill/teacher_advantage_abs" in metrics:
        teacher = metrics.pop("distill/teacher_advantage_abs")
        task = metrics.pop("distill/task_advantage_abs")
        metrics["distill/advantage_share"] = teacher / (teacher + task) \
            if teacher + task > 0 else float("nan")
    if "critic/returns_square" in metrics:
        returns_var = metrics.pop("critic/returns_square") - metrics["critic/returns_mean"] ** 2
        error_var = metrics.pop("critic/error_square") - metrics.pop("critic/error_mean") ** 2
        metrics["critic/explained_variance"] = 1 - error_var / returns_var \
            if returns_var > 0 else float("nan")
    return metrics

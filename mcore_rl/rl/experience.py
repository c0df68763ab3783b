"""A step's experience: generations and their scores as the [n, s] tensors the roles consume,
with the forward passes and advantages the update needs.

Rows are prompt+response sequences, right-padded. `response_mask` marks response tokens;
`loss_mask` is the subset that trains (overlong filtering removes truncated responses from it);
the outcome reward sits on each response's last token of `token_rewards`. `group_ids` name the
prompt a row answers (whole groups stay on one rank, as GRPO-style estimators need).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from mcore_rl.algorithms.advantages import AdvantageInputs, compute_advantages
from mcore_rl.algorithms.distillation import distilled_advantages, reverse_kl_advantages
from mcore_rl.algorithms.kl import KLController, apply_kl_penalty
from mcore_rl.algorithms.reward_shaping import RewardShaper
from mcore_rl.config import AlgorithmConfig
from mcore_rl.config.rl import RolloutConfig
from mcore_rl.config.teacher import TeacherConfig
from mcore_rl.observability.step_metrics import SumsAndCounts
from mcore_rl.rollout import Generation


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025): 0 up to max - buffer tokens, then
    falling linearly to -1 at max_new_tokens."""
    excess = (lengths - (max_new_tokens - buffer)).clamp(min=0).float()
    return -(excess / buffer).clamp(max=1.0)


def make_experience(generation: Generation, scores: list[float], rollout: RolloutConfig,
                    pad_id: int) -> dict[str, torch.Tensor]:
    """Tensors for the update: input_ids, attention_mask, response_mask, loss_mask,
    engine_logprobs, token_rewards [n, s]; scores, group_ids, truncated [n]."""
    batch = generation.response_tensors(pad_id)
    completions = generation.completions
    response_mask = batch["response_mask"]
    lengths = response_mask.sum(dim=1)
    truncated = torch.tensor([c.finish_reason == "length" for c in completions])
    scores = torch.tensor(scores, dtype=torch.float32)
    if rollout.overlong == "penalty":
        scores = scores + overlong_penalty(lengths, rollout.sampling.max_new_tokens,
                                           rollout.overlong_buffer)
    loss_mask = response_mask.clone()
    if rollout.overlong == "filter":
        loss_mask[truncated] = 0
    batch.update(loss_mask=loss_mask, group_ids=torch.tensor([c.prompt_index
                                                              for c in completions]),
                 truncated=truncated)
    _set_outcome_rewards(batch, scores)
    return batch


def _set_outcome_rewards(batch: dict, scores: torch.Tensor) -> None:
    """batch["scores"] = scores [n], and token_rewards [n, s]: each score on its response's
    last sampled token (a multi-turn episode may end on an observation; rows without a
    response get none)."""
    response_mask = batch["response_mask"]
    token_rewards = torch.zeros(response_mask.shape, dtype=torch.float32)
    positions = torch.arange(response_mask.shape[1], device=response_mask.device)
    last = (positions * response_mask).argmax(dim=1)
    has_response = response_mask.sum(dim=1) > 0
    rows = torch.arange(len(scores))[has_response]
    token_rewards[rows, last[has_response]] = scores[has_response]
    batch.update(scores=scores, token_rewards=token_rewards)


def shape_rewards(batch: dict, shaper: RewardShaper, dp_group, stats: SumsAndCounts) -> None:
    """Replace the batch's scores by the rewards the policy is trained on (reward.shaping:
    the missing-EOS penalty, centring, normalisation, clipping); their numbers go to stats.
    Without shaping the batch is left as it is."""
    if not shaper.config.active:
        return
    rewards, metrics = shaper(batch["scores"].double(), batch["truncated"], dp_group)
    for name, value in metrics.items():  # identical on every rank
        stats.add(name, torch.tensor([value]))
    _set_outcome_rewards(batch, rewards.float())


def mini_batches(batch: dict[str, torch.Tensor], count: int) -> list[dict[str, torch.Tensor]]:
    """`count` consecutive equal slices of the rows (the config guarantees they divide)."""
    rows = batch["input_ids"].shape[0]
    size = rows // count
    return [{name: tensor[start:start + size] for name, tensor in batch.items()}
            for start in range(0, rows, size)]


@dataclass
class Rollout:
    """One generate-and-score round on this rank: prompts, completions and their rewards."""

    records: list
    """The prompt records, in the order the engine saw them."""

    token_ids: list[list[int]]
    """Their prompt tokens."""

    generation: Generation
    """The engine's completions (`prompt_index` into `records`)."""

    results: list
    """One RewardResult per completion."""

    version: int = 0
    """The policy version (updates applied) whose weights generated it (the oldest that
    started one of its responses, where they differ)."""

    @property
    def scores(self) -> list[float]:
        return [result.score for result in self.results]

    def start_versions(self) -> torch.Tensor:
        """The policy version whose weights started each response, in completion order (the
        rollout's version unless the engine recorded versions per response)."""
        return torch.tensor([completion.versions[0][1] if completion.versions else self.version
                             for completion in self.generation.completions],
                            dtype=torch.float64)


def group_variation(scores: torch.Tensor, group_ids: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The groups of two or more responses, and whether each one's scores differ: only those
    carry a group-relative (GRPO) learning signal (DAPO's dynamic sampling keeps them). On the
    scores' device."""
    groups, members, sizes = group_ids.unique(return_inverse=True, return_counts=True)
    highest = scores.new_full(groups.shape, -float("inf")).scatter_reduce(0, members, scores,
                                                                          "amax")
    lowest = scores.new_full(groups.shape, float("inf")).scatter_reduce(0, members, scores,
                                                                        "amin")
    compared = sizes > 1
    return groups[compared], (highest > lowest)[compared]


def varied_groups(rollout: Rollout) -> list[int]:
    """Prompts whose responses did not all score the same (see group_variation)."""
    prompts = torch.tensor([c.prompt_index for c in rollout.generation.completions])
    groups, varied = group_variation(torch.tensor(rollout.scores, dtype=torch.float64), prompts)
    return groups[varied].tolist()


def select_groups(rollouts: list[Rollout], kept: list[list[int]]) -> Rollout:
    """One rollout made of the kept prompts (and all their completions) of several rounds."""
    records, token_ids, prompts, completions, results = [], [], [], [], []
    for rollout, prompt_indices in zip(rollouts, kept):
        new_index = {old: len(records) + i for i, old in enumerate(prompt_indices)}
        records += [rollout.records[i] for i in prompt_indices]
        token_ids += [rollout.token_ids[i] for i in prompt_indices]
        prompts += [rollout.generation.prompts[i] for i in prompt_indices]
        for completion, result in zip(rollout.generation.completions, rollout.results):
            if completion.prompt_index in new_index:
                completions.append(dataclasses.replace(
                    completion, prompt_index=new_index[completion.prompt_index]))
                results.append(result)
    metrics = {name: sum(r.generation.metrics.get(name, 0) for r in rollouts)
               for name in ("prompts", "truncated_prompts", "generated_tokens", "seconds",
                            "prompt_tokens", "cached_prompt_tokens")}
    return Rollout(records, token_ids, Generation(completions, prompts, metrics), results,
                   min(rollout.version for rollout in rollouts))


def add_forward_passes(batch: dict, roles, old_logprobs: str, routing_replay: str,
                       stats: SumsAndCounts) -> None:
    """Old log-probs (rollout.old_logprobs: an actor forward pass, or the engine's; none yet
    with `update`, whose update pass gives them), then each scoring role's pass (reference and
    teacher log-probs, the critic's old values: `Roles.scorers`) of the batch. A
    Mixture-of-Experts actor's pass also gives the step's MoE metrics (added to `stats`;
    identical on every rank) and, under r2, the routes the later passes replay."""
    metrics = {}
    if old_logprobs == "engine":
        batch["old_logprobs"] = batch["engine_logprobs"]
    elif old_logprobs == "trainer":
        outputs = roles.actor.logprobs(batch)
        batch["old_logprobs"] = outputs["logprobs"]
        metrics = outputs.get("moe_metrics", {})
        if routing_replay == "r2":
            batch["routed_experts"] = outputs["routed_experts"]
    for role in roles.scorers:
        batch[role.batch_key] = role.score(batch)
    for name, value in metrics.items():  # global already: every rank adds the same
        stats.add(name, torch.tensor([value]))


def add_advantages(batch: dict, algorithm: AlgorithmConfig, kl_controller: KLController,
                   dp_group, stats: SumsAndCounts) -> None:
    """Advantages and returns of the configured estimator, from the outcome rewards less the KL
    penalty when algorithm.use_kl_in_reward (the controller adapts to the measured KL)."""
    mask = batch["response_mask"]
    token_rewards = batch["token_rewards"]
    if algorithm.use_kl_in_reward:
        token_rewards, _ = apply_kl_penalty(token_rewards, batch["old_logprobs"],
                                            batch["ref_logprobs"], mask.float(), kl_controller,
                                            algorithm.kl_estimator, dp_group)
        stats.add("actor/kl_coef", torch.tensor([kl_controller.value]))
    inputs = AdvantageInputs(token_rewards=token_rewards, response_mask=mask.float(),
                             group_ids=batch["group_ids"], values=batch.get("old_values"),
                             reward_baselines=batch.get("reward_baselines"))
    batch["advantages"], batch["returns"] = compute_advantages(inputs, algorithm, dp_group)


def add_distillation(batch: dict, stats: SumsAndCounts, teacher: TeacherConfig) -> None:
    """Mix the teacher's per-token advantage into the estimator's (teacher.kl_coef and
    teacher.reward_weight); the reverse KL to the teacher, the teacher's log-probs and the
    two parts' sizes go to stats."""
    mask = batch["response_mask"].float()
    student, teacher_logprobs = batch["old_logprobs"], batch["teacher_logprobs"]
    task = batch["advantages"]
    from_teacher = reverse_kl_advantages(student, teacher_logprobs, mask)
    batch["advantages"] = distilled_advantages(task, from_teacher, teacher.reward_weight,
                                               teacher.kl_coef)
    stats.add("distill/reverse_kl", student - teacher_logprobs, mask)
    stats.add("distill/teacher_logprob", teacher_logprobs, mask)
    stats.add("distill/teacher_advantage_abs", (teacher.kl_coef * from_teacher).abs(), mask)
    stats.add("distill/task_advantage_abs", (teacher.reward_weight * task).abs(), mask)

"""Evaluation during RL: the validation prompts answered by the current policy, scored, gathered
on every rank and handed to the evaluators (the built-ins and those a user registers), plus the
policy's KL to the reference on those responses.

Each data-parallel rank generates for its share of the validation prompts; every rank then holds
everyone's samples, so every evaluator computes the same numbers everywhere.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_rl.algorithms.kl import kl_estimate
from mcore_rl.config import JobConfig
from mcore_rl.evaluation import EvalSamples, Evaluator, default_evaluators, run_evaluators
from mcore_rl.observability.step_metrics import SumsAndCounts
from mcore_rl.runtime.devices import collective_device
from mcore_rl.runtime.faults import kill_point
from mcore_rl.training.batches import pad_rows_to

from .data import TrainingData, check_validation_shards
from .step_parts import completion_statistics


class RLEvaluator:
    """Runs every evaluation of an RL job (collective)."""

    def __init__(self, config: JobConfig, data: TrainingData, responses, roles, dp_group):
        """responses(step) -> (records, generation, results): this rank's validation prompts
        answered by the current policy and scored (the rollout scheduler's `validation`)."""
        self.config = config
        self.data = data
        self.responses = responses
        self.roles = roles
        self.dp_group = dp_group
        self.evaluators: list[Evaluator] = default_evaluators()
        """Run at every evaluation; `Trainer.register_evaluator` adds more."""

    def evaluate(self, trainer, step: int) -> dict:
        """Generate `rollout.eval_sampling` responses to the validation prompts, score them and
        run the evaluators (each given `trainer`); with a reference model also the KL of the
        policy to it on these responses (trainer.eval_kl_to_reference)."""
        kill_point("evaluate")
        check_validation_shards(len(self.data.validation), self.data.dp_size)
        records, generation, results = self.responses(step)
        metrics = {}
        if self.roles.reference is not None and self.config.trainer.eval_kl_to_reference:
            metrics["eval/kl_to_reference"] = self._kl_to_reference(generation)
        samples = self._gather_samples(records, generation, results)
        metrics.update(run_evaluators(self.evaluators, trainer, samples))
        statistics = completion_statistics(self.config)
        if statistics:
            stats = SumsAndCounts()
            for add in statistics:
                add(generation.completions, stats)
            metrics.update({f"eval/{name}": value
                            for name, value in stats.reduce(self.dp_group).items()})
        return metrics

    def _gather_samples(self, records: list, generation, results: list) -> EvalSamples:
        """Every data-parallel rank's evaluated prompts, responses and scores, on every rank."""
        decode = self.data.tokenizer.decode
        mine = ([_prompt_text(record.prompt) for record in records],
                [record.data_source for record in records],
                [(c.prompt_index, c.token_ids, c.response_text if c.response_text is not None
                  else decode(c.token_ids, skip_special_tokens=True), result.score,
                  result.correct)
                 for c, result in zip(generation.completions, results)])
        shares = [None] * dist.get_world_size(self.dp_group)
        dist.all_gather_object(shares, mine, group=self.dp_group)
        prompts, sources, completions = [], [], []
        for share_prompts, share_sources, share_completions in shares:
            completions += [(len(prompts) + index, *rest) for index, *rest in share_completions]
            prompts += share_prompts
            sources += share_sources
        by_model = bool(self.config.reward.model_path)
        checked = [c[4] for c in completions]
        return EvalSamples(prompts=prompts, data_sources=sources,
                           prompt_index=[c[0] for c in completions],
                           response_token_ids=[list(c[1]) for c in completions],
                           responses=[c[2] for c in completions],
                           scores=[float(c[3]) for c in completions],
                           samples_per_prompt=self.config.rollout.eval_sampling.n,
                           scored_by="reward_model" if by_model else "rule",
                           checked=checked if by_model and None not in checked else None)

    def _kl_to_reference(self, generation) -> float:
        """Mean per-token KL (algorithm.kl_estimator) of the policy to the reference on the
        generated responses, over all data-parallel ranks."""
        rows = generation.response_tensors(self.data.pad_id)
        count = rows["input_ids"].shape[0]
        padded = pad_rows_to(rows, self._rows_on_every_rank(count))
        policy = self.roles.actor.logprobs(padded)["logprobs"][:count]
        reference = self.roles.reference.logprobs(padded)[:count]
        stats = SumsAndCounts()
        stats.add("kl", kl_estimate(policy, reference, self.config.algorithm.kl_estimator),
                  rows["response_mask"])
        return stats.reduce(self.dp_group)["kl"]

    def _rows_on_every_rank(self, count: int) -> int:
        """Rows each data-parallel rank scores: the most any rank has (validation shards may
        differ by a prompt), up to whole micro-batches. Equal micro-batch counts everywhere: at
        EP > 1 each one is an all-to-all over the data-parallel ranks."""
        most = torch.tensor([count], device=collective_device(self.dp_group))
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.dp_group)
        micro_batch_size = self.config.actor.micro_batch_size
        return -(-int(most.item()) // micro_batch_size) * micro_batch_size


def _prompt_text(prompt) -> str:
    """A prompt as text: itself, or its chat messages' contents one per line."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{message['role']}: {message['content']}" for message in prompt)

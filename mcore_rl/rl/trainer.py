"""The RL trainer: one SPMD program on every rank, the step reading like its pseudocode.

    prompts    = data.next_batch(dp_rank)
    engine.wake_weights(); sync weights actor -> engine (resharder); park training state
    engine.wake(); generate; engine.sleep(); restore training state
    rewards    = reward.score(samples)            (first rank of each model-parallel group)
    old_logp, ref_logp, values = actor / reference / critic forward passes
    advantages = estimator(rewards, values, groups)
    for epoch, mini-batch: critic.update(mb); actor.update(mb)
    log(metrics); checkpoint.maybe_save(step)

Every rank of a model-parallel group (TP x PP) must train on identical rows, so the group's
first rank is the source of truth for what was generated and how it scored: it broadcasts the
generation and the scores to the group. Data-parallel ranks hold different prompts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time

import torch
import torch.distributed as dist

from mcore_rl.algorithms.advantages import AdvantageInputs, compute_advantages
from mcore_rl.algorithms import unregistered_names
from mcore_rl.algorithms.kl import KLController, apply_kl_penalty, kl_estimate
from mcore_rl.config import JobConfig, to_yaml, validate_rl
from mcore_rl.config.rollout import PromptConfig
from mcore_rl.conversion.model_source import with_model_from_init
from mcore_rl.evaluation import EvalSamples, Evaluator, default_evaluators, run_evaluators
from mcore_rl.rewards import RewardResult
from mcore_rl.runtime import initialize, print0, shutdown
from mcore_rl.runtime.agreement import raise_on_any_rank
from mcore_rl.runtime.devices import collective_device
from mcore_rl.runtime.launch_env import read_launch_env
from mcore_rl.runtime.progress import progress
from mcore_rl.training.balance import balance_over_data_parallel
from mcore_rl.training.batches import pad_rows_to_multiple
from mcore_rl.training.offload import HostParking

from .api import with_actor_model
from .build import build_engine_and_roles, with_rank_order
from .data import TrainingData, load_training_data
from .experience import Rollout, make_experience, mini_batches, select_groups, varied_groups
from mcore_rl.observability.step_metrics import MetricsLogger, PhaseTimer, SumsAndCounts, peak_memory_metrics
from mcore_rl.runtime.preemption import PREEMPTED_EXIT_CODE, PreemptionFlag


class TrainingDiverged(RuntimeError):
    """Too many consecutive steps with non-finite losses or gradients."""


@dataclasses.dataclass
class Experience:
    """One step's scored, evaluated rollouts on this rank, ready for `update_policy`."""

    batch: dict
    """[n, s] tensors (see trainer.experience) plus old_logprobs, advantages, returns..."""

    stats: SumsAndCounts
    """Rollout statistics still to be reduced over data-parallel ranks."""

    timer: PhaseTimer
    """Seconds spent per phase so far in this step."""

    started: float
    """perf_counter() when the step began."""


class Trainer:
    """PPO/GRPO-family training of a Megatron actor (and critic) with a rollout engine."""

    def __init__(self, config: JobConfig, actor_model: str | None = None,
                 critic_model: str | None = None, reward_fn=None):
        """Every rank constructs the same Trainer. actor_model / critic_model: HF folders or
        mcore_rl checkpoints overriding init / critic.init_path (the critic must share the
        actor's architecture). reward_fn: a module-level function fn(data_source, solution_str,
        ground_truth, extra_info) -> float | dict used for every sample instead of the reward
        registry."""
        if actor_model is not None:
            config = with_actor_model(config, actor_model)
        if critic_model is not None:
            config = dataclasses.replace(config, critic=dataclasses.replace(
                config.critic, init_path=critic_model))
        launch = read_launch_env()
        config = with_model_from_init(config)
        config = self.config = with_rank_order(validate_rl(
            config, launch.world_size, unregistered_names(config.algorithm)),
                                               launch.ranks_per_node, launch.world_size)
        self.preemption = PreemptionFlag(config.trainer.save_signal)
        self.preempted = False
        """Whether fit() stopped early on trainer.save_signal (after saving)."""
        self.runtime = initialize(config, launch)
        self.checkpoint_dir = os.path.join(config.runtime.output_dir, "checkpoints")
        self._refuse_to_mix_runs()
        from megatron.core import parallel_state

        self.dp_group = parallel_state.get_data_parallel_group()
        self.mp_group = parallel_state.get_model_parallel_group()
        self.mp_source = dist.get_process_group_ranks(self.mp_group)[0]
        self.data: TrainingData = load_training_data(
            config, parallel_state.get_data_parallel_rank(),
            parallel_state.get_data_parallel_world_size(), reward_fn,
            is_scorer=dist.get_rank() == self.mp_source)
        self.engine, self.weight_sync, self.roles = build_engine_and_roles(
            config, self.runtime.device, config.data.max_prompt_tokens)
        self.parkings = [HostParking(role.trainable) for role, role_config in
                         ((self.roles.actor, config.actor), (self.roles.critic, config.critic))
                         if role is not None and role_config.offload]
        """Host-memory parking of the roles with `offload` set, used while generating."""
        algorithm = config.algorithm
        self.kl_controller = KLController(algorithm.kl_coef, algorithm.kl_controller == "adaptive",
                                          algorithm.target_kl, algorithm.kl_horizon)
        self.prompt_config = PromptConfig(max_prompt_tokens=config.data.max_prompt_tokens)
        self.step = 0
        self.bad_steps = 0
        self.pending_rollout: Rollout | None = None
        """With async_rollout: the batch generated ahead for the next step (this rank's)."""
        self.engine_weights_current = False
        """Whether the engine holds the actor's current weights (no update since the sync)."""
        self.logger = MetricsLogger.for_job(config)
        self.evaluators: list[Evaluator] = default_evaluators()
        """Run at every evaluation; `register_evaluator` adds more."""
        if dist.get_rank() == 0:
            _write_atomically(os.path.join(config.runtime.output_dir, "config.yaml"),
                              to_yaml(config))
        if config.trainer.resume:
            self._resume()
        self.preemption.arm()

    # -- the step ---------------------------------------------------------------------------
    def collect_data(self, prompts: list | None = None) -> Experience:
        """Generate, score and evaluate one batch: this rank's share of `prompts` (a global list
        of texts or PromptRecords, identical on every rank) or the sampler's next batch."""
        started, timer, stats = time.perf_counter(), PhaseTimer(), SumsAndCounts()
        if prompts is not None:
            rollout = self._rollout(*self.data.encode_global(prompts), timer)
        elif self.config.rollout.async_rollout:
            rollout = self._rollout_one_step_ahead(timer)
        elif self.config.rollout.dynamic_sampling:
            rollout = self._rollout_varied_groups(timer, stats)
        else:
            rollout = self._rollout(*self.data.next_batch(), timer)
        batch = make_experience(rollout.generation, rollout.scores, self.config.rollout,
                                self.data.pad_id)
        if self.config.algorithm.estimator == "remax":
            with timer("generate_baseline"):
                batch["reward_baselines"] = self._greedy_scores(rollout)[batch["group_ids"]]
        with timer("logprobs"):
            self._evaluate_batch(batch)
        with timer("advantages"):
            self._advantages(batch, stats)
        _rollout_statistics(batch, rollout.results, rollout.generation.metrics, stats)
        if self.weight_sync is not None:
            self.weight_sync.add_metrics(stats)
        if self.config.trainer.balance_data_parallel:
            with timer("balance"):
                batch = self._balanced(batch, stats)
        return Experience(batch, stats, timer, started)

    def _balanced(self, batch: dict, stats: SumsAndCounts) -> dict:
        """The batch with rows moved between data-parallel ranks so that each holds about the
        same number of tokens for the update (groups and advantages are already computed)."""
        batch, balance = balance_over_data_parallel(batch, self.dp_group)
        for name, value in balance.items():  # identical on every rank: the mean is the value
            stats.add(name, torch.tensor([float(value)]))
        return batch

    def _rollout(self, records: list, token_ids: list, timer: PhaseTimer,
                 round_index: int = 0) -> Rollout:
        """Generate (engine awake only meanwhile) and score one round of prompts."""
        with self._engine_awake(timer), timer("generate"):
            generation = self.engine.generate(token_ids, self._sampling(round_index),
                                              self.prompt_config)
        with timer("reward"):
            generation, results = self._score(generation, records)
        return Rollout(records, token_ids, generation, results)

    def _rollout_one_step_ahead(self, timer: PhaseTimer) -> Rollout:
        """One-step off-policy rollout: train on the batch generated during the previous step
        (by the policy before that step's update) and generate the next one now. The truncated
        importance weight (rollout.importance_cap) corrects for the lag."""
        if self.pending_rollout is None:
            self.pending_rollout = self._rollout(*self.data.next_batch(), timer)
        current = self.pending_rollout
        self.pending_rollout = self._rollout(*self.data.next_batch(), timer, round_index=1)
        return current

    def _rollout_varied_groups(self, timer: PhaseTimer, stats: SumsAndCounts) -> Rollout:
        """DAPO's dynamic sampling: keep only groups whose rewards differ, generating more
        rounds until every data-parallel rank has a full batch of them (or rollout.
        max_sampling_rounds is reached; then every rank trains on as many as the poorest has,
        cut to whole micro-batches, falling back to the unfiltered first round when none)."""
        wanted = self.config.rollout.prompts_per_step // self.data.dp_size
        rounds, kept = [], []
        for round_index in range(self.config.rollout.max_sampling_rounds):
            rounds.append(self._rollout(*self.data.next_batch(), timer, round_index))
            kept.append(varied_groups(rounds[-1]))
            fewest = self._fewest_over_data_parallel(sum(map(len, kept)))
            if fewest >= wanted:
                break
        usable = min(wanted, fewest) // self._group_unit() * self._group_unit()
        stats.add("rollout/sampling_rounds", torch.tensor([float(len(rounds))]))
        stats.add("rollout/varied_group_fraction", torch.tensor(
            [sum(map(len, kept)) / (len(rounds) * wanted)]))
        if usable == 0:
            print0("dynamic sampling: no rank found enough groups with varied rewards; "
                   "training on the unfiltered first round")
            return rounds[0]
        trimmed, remaining = [], usable
        for prompt_indices in kept:
            trimmed.append(prompt_indices[:remaining])
            remaining -= len(trimmed[-1])
        return select_groups(rounds, trimmed)

    def _fewest_over_data_parallel(self, count: int) -> int:
        holder = torch.tensor([count], dtype=torch.int64,
                              device=collective_device(self.dp_group))
        dist.all_reduce(holder, op=dist.ReduceOp.MIN, group=self.dp_group)
        return int(holder.item())

    def _group_unit(self) -> int:
        """Smallest number of prompts whose responses cut into the configured mini- and
        micro-batches."""
        n = self.config.rollout.sampling.n
        micro_batch = _rows_per_micro_batch(self.config.actor)
        if self.roles.critic is not None:
            micro_batch = math.lcm(micro_batch, _rows_per_micro_batch(self.config.critic))
        rows_unit = self.config.trainer.mini_batches * micro_batch
        return rows_unit // math.gcd(rows_unit, n)

    def update_policy(self, experience: Experience) -> dict:
        """PPO epochs over mini-batches for the critic, then the actor; returns the step's
        metrics (identical on every rank; 'reward' is the mean score)."""
        timer, batch = experience.timer, experience.batch
        updates = SumsAndCounts()
        skipped = False
        self.engine_weights_current = False
        with timer("update"):
            for _ in range(self.config.trainer.ppo_epochs):
                for mini_batch in mini_batches(batch, self.config.trainer.mini_batches):
                    metrics = {}
                    if self.roles.critic is not None:
                        metrics.update(self.roles.critic.update(mini_batch))
                    metrics.update(self.roles.actor.update(mini_batch))
                    skipped |= any(metrics.pop(name) for name in list(metrics)
                                   if name.endswith("update_skipped"))
                    for name, value in metrics.items():
                        updates.add(name, torch.tensor([value]))
        metrics = _derived(experience.stats.reduce(self.dp_group))
        metrics.update(updates.means())  # already global: every rank holds the same values
        metrics.update(timer.metrics())
        metrics.update(peak_memory_metrics())
        seconds = time.perf_counter() - experience.started
        metrics.update({"time/step": seconds, "reward": metrics["reward/mean"],
                        "throughput/tokens_per_second": metrics["throughput/tokens"] / seconds,
                        "training/update_skipped": float(skipped)})
        return metrics

    def train_step(self) -> dict:
        """collect_data + update_policy on the sampler's next batch, then log and save."""
        metrics = self.update_policy(self.collect_data())
        self.step += 1
        self._track_bad_steps(metrics)
        self.logger.log(self.step, metrics)
        if self._save_due():
            self.save()
        export_every = self.config.trainer.export_hf_every
        if export_every and (self.step % export_every == 0
                             or self.step == self.config.trainer.total_steps):
            self.export_hf()
        return metrics

    def export_hf(self) -> str:
        """The actor as an HF folder output_dir/hf/step_<N> (collective)."""
        from mcore_rl.conversion.export import export_actor_to_hf
        from mcore_rl.models.weights import local_parameters

        out_dir = os.path.join(self.config.runtime.output_dir, "hf", f"step_{self.step:08d}")
        export_actor_to_hf(self.config, local_parameters(self.roles.actor.module),
                           self.data.tokenizer, out_dir)
        print0(f"step {self.step}: exported the actor to {out_dir}")
        return out_dir

    def _save_due(self) -> bool:
        """Whether train_step saves (saved) a checkpoint after the current step."""
        trainer = self.config.trainer
        return bool(trainer.save_every) and (self.step % trainer.save_every == 0
                                             or self.step == trainer.total_steps)

    def fit(self) -> list[dict]:
        """Train until trainer.total_steps (continuing a resumed run), evaluating before the
        first step, every trainer.eval_every steps and after the last; returns the metrics of
        the steps run here. Rank 0 then draws the run's plots (trainer.plots)."""
        history = []
        every, total_steps = self.config.trainer.eval_every, self.config.trainer.total_steps
        if every and self.step == 0:
            self.logger.log(0, self.evaluate(), "eval")
        with progress(total=total_steps, initial=self.step, desc="train", unit="step") as bar:
            while self.step < total_steps:
                history.append(self.train_step())
                bar.update(1)
                if self.preemption.raised_anywhere():
                    self._save_for_requeue()
                    break
                if every and (self.step % every == 0 or self.step == total_steps):
                    self.logger.log(self.step, self.evaluate(), "eval")
        if self.config.trainer.plots and dist.get_rank() == 0:
            from mcore_rl.observability import plot_run
            paths = plot_run(self.config.runtime.output_dir)
            print0(f"plots: {', '.join(str(path) for path in paths)}")
        return history

    def _save_for_requeue(self) -> None:
        if not self._save_due():
            self.save()
        self.preempted = True
        print0(f"step {self.step}: {self.config.trainer.save_signal} received; saved "
               f"{self.checkpoint_dir} and stopping (exit status {PREEMPTED_EXIT_CODE})")

    def evaluate(self) -> dict:
        """Generate `rollout.eval_sampling` responses to the validation prompts (each
        data-parallel rank a share), score them, gather them on every rank and run the
        evaluators (the built-ins and those registered); with a reference model also the KL of
        the policy to it on these responses."""
        records, token_ids = self.data.validation_shard()
        sampling = dataclasses.replace(self.config.rollout.eval_sampling,
                                       stop_token_ids=self.data.stop_token_ids,
                                       seed=self.config.runtime.seed)
        with self._engine_awake():
            generation = self.engine.generate(token_ids, sampling, self.prompt_config)
        generation, results = self._score(generation, records)
        metrics = {}
        if self.roles.reference is not None:
            metrics["eval/kl_to_reference"] = self._kl_to_reference(generation)
        samples = self._gather_eval_samples(records, generation, results)
        metrics.update(run_evaluators(self.evaluators, self, samples))
        return metrics

    def register_evaluator(self, evaluator: Evaluator) -> None:
        """Run `evaluator.evaluate(trainer, samples)` at every evaluation (on every rank, with
        the samples of all ranks); its metrics are logged with an 'eval/' prefix."""
        self.evaluators.append(evaluator)

    def _gather_eval_samples(self, records: list, generation, results: list) -> EvalSamples:
        """Every data-parallel rank's evaluated prompts, responses and scores, on every rank."""
        decode = self.data.tokenizer.decode
        mine = ([_prompt_text(record.prompt) for record in records],
                [record.data_source for record in records],
                [(c.prompt_index, c.token_ids, decode(c.token_ids, skip_special_tokens=True),
                  result.score) for c, result in zip(generation.completions, results)])
        shares = [None] * dist.get_world_size(self.dp_group)
        dist.all_gather_object(shares, mine, group=self.dp_group)
        prompts, sources, completions = [], [], []
        for share_prompts, share_sources, share_completions in shares:
            completions += [(len(prompts) + index, *rest) for index, *rest in share_completions]
            prompts += share_prompts
            sources += share_sources
        return EvalSamples(prompts=prompts, data_sources=sources,
                           prompt_index=[c[0] for c in completions],
                           response_token_ids=[list(c[1]) for c in completions],
                           responses=[c[2] for c in completions],
                           scores=[float(c[3]) for c in completions],
                           samples_per_prompt=self.config.rollout.eval_sampling.n)

    def _kl_to_reference(self, generation) -> float:
        """Mean per-token KL (algorithm.kl_estimator) of the policy to the reference on the
        generated responses, over all data-parallel ranks."""
        rows = generation.response_tensors(self.data.pad_id)
        count = rows["input_ids"].shape[0]
        padded = pad_rows_to_multiple(rows, self.config.actor.micro_batch_size)
        policy = self.roles.actor.logprobs(padded)["logprobs"][:count]
        reference = self.roles.reference.logprobs(padded)[:count]
        stats = SumsAndCounts()
        stats.add("kl", kl_estimate(policy, reference, self.config.algorithm.kl_estimator),
                  rows["response_mask"])
        return stats.reduce(self.dp_group)["kl"]

    # -- pieces of the step ------------------------------------------------------------------
    def _sampling(self, round_index: int = 0):
        """Training sampling with the stop tokens and a seed fixed by the step (and the round
        of dynamic sampling), so a resumed run draws what an uninterrupted one would."""
        return dataclasses.replace(
            self.config.rollout.sampling, stop_token_ids=self.data.stop_token_ids,
            seed=(self.config.runtime.seed * 100_003 + self.step) * 101 + round_index)

    def _greedy_scores(self, rollout: Rollout) -> torch.Tensor:
        """Score of the greedy response to each prompt (ReMax's baseline)."""
        sampling = dataclasses.replace(self.config.rollout.sampling, n=1, temperature=0.0,
                                       stop_token_ids=self.data.stop_token_ids)
        with self._engine_awake():
            generation = self.engine.generate(rollout.token_ids, sampling, self.prompt_config)
        _, results = self._score(generation, rollout.records)
        return torch.tensor([result.score for result in results], dtype=torch.float32)

    @contextlib.contextmanager
    def _engine_awake(self, timer: PhaseTimer | None = None):
        """The engine holds its weights and KV cache only meanwhile, with the actor's current
        weights; roles configured with offload park their device memory in host memory for
        that time (phases 'switch' and 'reshard'). The order is the GPU's: weights are written
        into mapped memory, and the KV cache returns once training state is parked."""
        timer = timer or PhaseTimer()
        with timer("switch"):
            self.engine.wake_weights()
        with timer("reshard"):
            self._sync_weights()
        with timer("switch"):
            for parking in self.parkings:
                parking.park()
            self.engine.wake()
        try:
            yield
        finally:
            with timer("switch"):
                self.engine.sleep()
                self.engine_weights_current &= self.engine.weights_survive_sleep
                for parking in self.parkings:
                    parking.restore()

    def _sync_weights(self) -> None:
        """Send the actor's weights to the engine unless it already has them (an evaluation
        right before the next step's rollout syncs once, where sleeping keeps weights)."""
        if self.weight_sync is not None and not self.engine_weights_current:
            self.weight_sync.sync(self.roles.actor.parameters_for_sync())
        self.engine_weights_current = True

    def _score(self, generation, records):
        """The model-parallel group's first rank scores its generation with the rule rewards
        and hands both to the rest of the group, so every stage and TP rank trains on the same
        rows; a reward model instead scores on every rank, after the hand-over."""
        payload = [(generation, None)]
        if dist.get_rank() == self.mp_source and self.data.reward is not None:
            payload = [(generation, self.data.reward.score(generation, records,
                                                           f"step{self.step}"))]
        if dist.get_world_size(self.mp_group) > 1:
            dist.broadcast_object_list(payload, src=self.mp_source, group=self.mp_group)
        generation, results = payload[0]
        if self.roles.reward_model is not None:
            rows = generation.response_tensors(self.data.pad_id)
            scores = self.roles.reward_model.score(rows["input_ids"], rows["attention_mask"])
            results = [RewardResult(float(score)) for score in scores.tolist()]
        return generation, results

    def _evaluate_batch(self, batch: dict) -> None:
        """Old log-probs (actor), reference log-probs and old values (critic) of the batch."""
        roles = self.roles
        batch["old_logprobs"] = roles.actor.logprobs(batch)["logprobs"]
        if roles.reference is not None:
            batch["ref_logprobs"] = roles.reference.logprobs(batch)
        if roles.critic is not None:
            batch["old_values"] = roles.critic.values(batch)

    def _advantages(self, batch: dict, stats: SumsAndCounts) -> None:
        algorithm = self.config.algorithm
        mask = batch["response_mask"]
        token_rewards = batch["token_rewards"]
        if "ref_logprobs" in batch:
            kl = kl_estimate(batch["old_logprobs"], batch["ref_logprobs"],
                             algorithm.kl_estimator)
            stats.add("actor/kl_to_reference", kl, mask)
        if algorithm.use_kl_in_reward:
            token_rewards, _ = apply_kl_penalty(token_rewards, batch["old_logprobs"],
                                                batch["ref_logprobs"], mask.float(),
                                                self.kl_controller, algorithm.kl_estimator,
                                                self.dp_group)
            stats.add("actor/kl_coef", torch.tensor([self.kl_controller.value]))
        inputs = AdvantageInputs(token_rewards=token_rewards, response_mask=mask.float(),
                                 group_ids=batch["group_ids"], values=batch.get("old_values"),
                                 reward_baselines=batch.get("reward_baselines"))
        batch["advantages"], batch["returns"] = compute_advantages(inputs, algorithm,
                                                                   self.dp_group)

    def _track_bad_steps(self, metrics: dict) -> None:
        bad = is_bad_step(metrics)
        self.bad_steps = self.bad_steps + 1 if bad else 0
        if bad:
            print0(f"step {self.step}: update skipped (non-finite loss or gradient norm), "
                   f"{self.bad_steps} in a row")
        if self.bad_steps >= self.config.trainer.max_bad_steps:
            raise TrainingDiverged(
                f"{self.bad_steps} consecutive steps with non-finite losses or gradients "
                f"(trainer.max_bad_steps={self.config.trainer.max_bad_steps}); the newest "
                f"checkpoint in {self.checkpoint_dir} is from before them")

    # -- checkpoints ---------------------------------------------------------------------------
    def _trained_models(self) -> dict:
        models = {"actor": self.roles.actor.trainable}
        if self.roles.critic is not None:
            models["critic"] = self.roles.critic.trainable
        return models

    def save(self) -> str:
        """Checkpoint everything a bitwise resume needs (collective)."""
        from mcore_rl.training.checkpointer import save_training_state

        state = {"sampler": self.data.sampler.state_dict(),
                 "kl_controller": self.kl_controller.state_dict(), "bad_steps": self.bad_steps}
        return save_training_state(self.checkpoint_dir, self.step, self._trained_models(), state,
                                   to_yaml(self.config), self.config.trainer.keep_last,
                                   rank_state={"pending_rollout": self.pending_rollout})

    def _refuse_to_mix_runs(self) -> None:
        """A run with nothing to resume must not append to an earlier run's logs (rank 0 looks,
        every rank raises)."""
        from mcore_rl.training.checkpointer import latest_checkpoint
        from mcore_rl.observability import METRICS_FILE

        output_dir = self.config.runtime.output_dir
        metrics = os.path.join(output_dir, METRICS_FILE)
        problems = []
        if dist.get_rank() == 0 and os.path.isfile(metrics) and os.path.getsize(metrics) and not (
                self.config.trainer.resume and latest_checkpoint(self.checkpoint_dir)):
            problems.append(f"runtime.output_dir={output_dir} holds an earlier run ({metrics}) "
                            f"and no checkpoint to resume from (or trainer.resume=false); "
                            f"choose another runtime.output_dir or delete that one")
        raise_on_any_rank(problems, FileExistsError, "")

    def _resume(self) -> None:
        from mcore_rl.training.checkpointer import load_latest_training_state

        loaded = load_latest_training_state(self.checkpoint_dir, self._trained_models())
        if loaded is None:
            return
        self.step, state = loaded
        self.data.sampler.load_state_dict(state["sampler"])
        self.kl_controller.load_state_dict(state["kl_controller"])
        self.bad_steps = state["bad_steps"]
        self.pending_rollout = state["rank_state"]["pending_rollout"]
        print0(f"resumed from step {self.step} ({self.checkpoint_dir})")

    def close(self) -> None:
        """Stop reward workers and TensorBoard, and leave the process group."""
        self.data.close()
        self.logger.close()
        self.engine.close()
        shutdown()


def _write_atomically(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as handle:
        handle.write(text)
    os.replace(path + ".tmp", path)


def _rows_per_micro_batch(role_config) -> int:
    """The row count a role's micro-batches need (any count with a token budget)."""
    return 1 if role_config.max_tokens_per_micro_batch else role_config.micro_batch_size


def _prompt_text(prompt) -> str:
    """A prompt as text: itself, or its chat messages' contents one per line."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{message['role']}: {message['content']}" for message in prompt)


def is_bad_step(metrics: dict) -> bool:
    """A step whose update was skipped or whose losses or gradient norms are not finite."""
    return metrics["training/update_skipped"] > 0 or not all(
        math.isfinite(value) for name, value in metrics.items()
        if name.endswith(("/loss", "/grad_norm")))


def _rollout_statistics(batch: dict, results: list, generation_metrics: dict,
                        stats: SumsAndCounts) -> None:
    """This rank's rollout numbers: rewards, lengths, advantages, values, mismatch."""
    scores = batch["scores"].double()
    stats.add("reward/mean", scores)
    stats.add("reward/square", scores.square())
    stats.add("reward/accuracy", (scores >= 1.0).double())
    stats.add("reward/errors", torch.tensor([sum(r.error is not None for r in results)],
                                            dtype=torch.float64))
    response = batch["response_mask"].bool()
    lengths = response.sum(dim=1).double()
    stats.add("response/length_mean", lengths)
    stats.add_max("response/length_max", lengths)
    stats.add("response/truncated", batch["truncated"].double())
    stats.add("throughput/tokens", torch.tensor([float(batch["attention_mask"].sum())]))
    stats.add("advantages/mean", batch["advantages"], response)
    stats.add_max("advantages/max", batch["advantages"][response])
    stats.add_max("advantages/neg_min", -batch["advantages"][response])
    delta = (batch["old_logprobs"] - batch["engine_logprobs"]).double()
    stats.add("rollout/logprob_abs_diff_mean", delta.abs(), response)
    stats.add_max("rollout/logprob_abs_diff_max", delta.abs()[response])
    stats.add("rollout/k3_kl", delta.exp() - 1 - delta, response)
    stats.add("rollout/truncated_prompts",
              torch.tensor([float(generation_metrics.get("truncated_prompts", 0))]))
    if "old_values" in batch:
        values, returns = batch["old_values"].double(), batch["returns"].double()
        stats.add("critic/values_mean", values, response)
        stats.add("critic/returns_mean", returns, response)
        stats.add("critic/returns_square", returns.square(), response)
        stats.add("critic/error_mean", returns - values, response)
        stats.add("critic/error_square", (returns - values).square(), response)


def _derived(metrics: dict) -> dict:
    """Standard deviations, the advantage minimum and the critic's explained variance from the
    reduced sums (helper entries removed)."""
    metrics["reward/std"] = math.sqrt(max(metrics.pop("reward/square")
                                          - metrics["reward/mean"] ** 2, 0.0))
    metrics["advantages/min"] = -metrics.pop("advantages/neg_min")
    if "critic/returns_square" in metrics:
        returns_var = metrics.pop("critic/returns_square") - metrics["critic/returns_mean"] ** 2
        error_var = metrics.pop("critic/error_square") - metrics.pop("critic/error_mean") ** 2
        metrics["critic/explained_variance"] = 1 - error_var / returns_var \
            if returns_var > 0 else float("nan")
    return metrics

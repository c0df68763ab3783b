"""The RL trainer: one SPMD program on every rank, the step reading like its pseudocode.

    rollout    = scheduler.next(step)             prompts -> engine (actor's weights, resharded)
                                                  -> samples -> scorer.score(samples)
    old_logp = actor pass; batch[role.batch_key] = role.score(batch) for each scoring role
                                                  (reference, teacher, critic: Roles.scorers)
    advantages = estimator(rewards, values, groups); each advantage term adds its part
    for epoch, mini-batch: critic.update(mb); actor.update(mb)
    log(metrics); checkpoint.maybe_save(step)

The Trainer builds the components and calls them in that order: the rollout scheduler (how a
batch is produced: synchronous, one step ahead, dynamic sampling), the generator (the engine with
the actor's current weights), the scorer (rule rewards or a reward model), the roles, the
evaluator, the metrics logger and the training-state checkpointer. What a feature adds to the
step (distillation's advantage term, multi-turn episodes' statistics) is declared once in
rl/step_parts.py; what a checkpoint carries of the trainer, once in `self.saved`. Every part
receives this rank's place in the layout (`Runtime.training`) instead of asking for it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time

import torch
import torch.distributed as dist

from mcore_rl.algorithms.kl import KLController
from mcore_rl.algorithms.reward_shaping import RewardShaper
from mcore_rl.config import JobConfig, to_yaml
from mcore_rl.config.rollout import PromptConfig
from mcore_rl.evaluation import Evaluator
from mcore_rl.evaluation.model_selection import ModelSelection
from mcore_rl.evaluation.reward_hacking import RewardHackingMonitor
from mcore_rl.observability import METRICS_FILE, refuse_earlier_run
from mcore_rl.observability.step_metrics import (MetricsLogger, PhaseTimer, SumsAndCounts,
                                                 peak_memory_metrics)
from mcore_rl.observability.timeline import Timeline
from mcore_rl.observability.trained_prompts import TrainedPromptsLog
from mcore_rl.roles import Scorer
from mcore_rl.runtime import Runtime, initialize, print0, shutdown
from mcore_rl.runtime.files import write_text_atomically
from mcore_rl.runtime.launch_env import read_launch_env
from mcore_rl.runtime.preemption import PREEMPTED_EXIT_CODE, PreemptionFlag
from mcore_rl.runtime.progress import progress
from mcore_rl.training import checkpointer
from mcore_rl.training.balance import balance_over_data_parallel
from mcore_rl.training.offload import HostParking

from .api import with_agent, with_environment
from .build import (build_engine_and_roles, build_episode_runner, build_roles,
                    settled_config, start_rule_reward)
from .data import load_training_data
from .evaluator import RLEvaluator
from .experience import (add_advantages, add_forward_passes,
                         make_experience, mini_batches, shape_rewards)
from .generator import PolicyGenerator
from .rollout_scheduler import RolloutScheduler
from .saved_state import SavedState
from .split.remote_rollouts import RemoteRollouts
from .step_guards import StepGuards
from .step_parts import advantage_terms, completion_statistics
from .step_statistics import (derived_metrics, off_policy_statistics,
                              old_logprob_statistics, rollout_statistics)


@dataclasses.dataclass
class Experience:
    """One step's scored, evaluated rollouts on this rank, ready for `update_policy`."""

    batch: dict
    """[n, s] tensors (see rl.experience) plus old_logprobs, advantages, returns..."""

    stats: SumsAndCounts
    """Rollout statistics still to be reduced over data-parallel ranks."""

    timer: PhaseTimer
    """Seconds spent per phase so far in this step."""

    started: float
    """perf_counter() when the step began."""

    prompts: list
    """The prompt records this rank's part of the batch was generated from."""


class Trainer:
    """PPO/GRPO-family training of a Megatron actor (and critic) with a rollout engine."""

    def __init__(self, config: JobConfig, actor_model: str | None = None,
                 critic_model: str | None = None, reward_fn=None, environment=None,
                 agent=None):
        """Every rank constructs the same Trainer. actor_model / critic_model: HF folders or
        mcore_rl checkpoints overriding init / critic.init_path (the critic must share the
        actor's architecture). reward_fn: a module-level function fn(data_source, solution_str,
        ground_truth, extra_info) -> float | dict used for every sample instead of the reward
        registry. environment: an mcore_rl.agents.Environment subclass for multi-turn
        rollouts (instead of rollout.multi_turn.environment). agent: a module-level
        `async def run(row, base_url) -> reward` driving each episode through an OpenAI
        endpoint on the rank's engine (instead of rollout.multi_turn.agent)."""
        from mcore_rl.observability.startup import STARTUP, FirstStepLogger

        launch = read_launch_env()
        if environment is not None:
            config = with_environment(config, environment)
        if agent is not None:
            config = with_agent(config, agent)
        with STARTUP.phase("config_check"):
            config = self.config = settled_config(config, launch, actor_model, critic_model)
        if config.placement.side_of(launch.rank, launch.world_size) == "rollout":
            raise ValueError(f"rank {launch.rank} is a rollout rank of split placement "
                             f"(placement.rollout_ranks={config.placement.rollout_ranks}): run "
                             "mcore_rl.rl.run_training(config) on every rank")
        self.preemption = PreemptionFlag(config.trainer.save_signal)
        self.preempted = False
        """Whether fit() stopped early on trainer.save_signal (after saving)."""
        with STARTUP.phase("process_groups"):
            self.runtime = initialize(config, launch)
        self.checkpoint_dir = os.path.join(config.runtime.output_dir, "checkpoints")
        resumable = config.trainer.resume and (
            checkpointer.latest_checkpoint(self.checkpoint_dir) or _same_run(config))
        refuse_earlier_run(config.runtime.output_dir, () if resumable else (METRICS_FILE,),
                           "holds an earlier run", " and no checkpoint to resume from (or "
                           "trainer.resume=false)")
        here = self.runtime.training
        self.dp_group = here.group("dp")
        with STARTUP.phase("data"):
            self.data = load_training_data(config, here.dp_rank, here.dp_size)
        if self.runtime.split is None:
            self.roles, self.scheduler = _colocated_rollouts(config, self.data, reward_fn,
                                                              self.runtime)
        else:
            self.roles = build_roles(config, self.runtime, self.data.tokenizer)
            self.scheduler = RemoteRollouts(config, self.data, self.runtime.split,
                                            self.roles.actor, here)
        self.evaluator = RLEvaluator(config, self.data, self.scheduler.validation, self.roles,
                                     self.dp_group)
        algorithm = config.algorithm
        self.kl_controller = KLController(algorithm.kl_coef, algorithm.kl_controller == "adaptive",
                                          algorithm.target_kl, algorithm.kl_horizon)
        self.reward_shaper = RewardShaper(config.reward.shaping)
        self.hacking_monitor = RewardHackingMonitor(config.trainer.reward_hacking)
        self.selection = ModelSelection(config.trainer.selection)
        self.advantage_terms = advantage_terms(config)
        self.completion_statistics = completion_statistics(config)
        self.step = 0
        self.guards = StepGuards(config.trainer.max_bad_steps, config.reward.max_failed_steps,
                                 self.checkpoint_dir)
        self.saved = SavedState(sampler=self.data.sampler, kl_controller=self.kl_controller,
                                bad_steps=self.guards, reward_hacking=self.hacking_monitor,
                                reward_shaping=self.reward_shaper, selection=self.selection)
        """What a checkpoint carries of the trainer, by name (rank 0's copy)."""
        self.logger = FirstStepLogger(MetricsLogger.for_job(config), STARTUP)
        self.timeline = Timeline(config.runtime.output_dir)
        self.trained_prompts = TrainedPromptsLog(config.runtime.output_dir, self.dp_group)
        if dist.get_rank() == 0:
            write_text_atomically(os.path.join(config.runtime.output_dir, "config.yaml"),
                                  to_yaml(config))
        if config.trainer.resume:
            self._resume()
        self.scheduler.start(self.step)
        self.preemption.arm()
        STARTUP.report(dist.get_rank())

    # -- the step ---------------------------------------------------------------------------
    def collect_data(self, prompts: list | None = None) -> Experience:
        """Generate, score and evaluate one batch: this rank's share of `prompts` (a global list
        of texts or PromptRecords, identical on every rank) or the sampler's next batch."""
        started, timer, stats = time.perf_counter(), PhaseTimer(), SumsAndCounts()
        rollout = self.scheduler.next(self.step, timer, stats, prompts)
        batch = make_experience(rollout.generation, rollout.scores, self.config.rollout,
                                self.data.pad_id)
        shape_rewards(batch, self.reward_shaper, self.dp_group, stats)
        if self.config.algorithm.needs_greedy_baseline:
            with timer("generate_baseline"):
                baselines = self.scheduler.greedy_scores(rollout, self.step)
                batch["reward_baselines"] = baselines[batch["group_ids"]]
        old_logprobs = self.config.old_logprob_source()
        with timer("logprobs"):
            add_forward_passes(batch, self.roles, old_logprobs,
                               self.config.rollout.routing_replay, stats)
        with timer("advantages"):
            add_advantages(batch, self.config.algorithm, self.kl_controller, self.dp_group, stats)
            for add_term in self.advantage_terms:
                add_term(batch, stats)
        rollout_statistics(batch, rollout.results, rollout.generation.metrics, stats)
        for add_statistics in self.completion_statistics:
            add_statistics(rollout.generation.completions, stats)
        off_policy_statistics(batch, rollout, self.step, stats)
        if old_logprobs != "update":
            self._old_logprob_statistics(batch, stats)
        self.scheduler.add_metrics(stats)
        if self.config.trainer.balance_data_parallel:
            with timer("balance"):
                batch = self._balanced(batch, stats)
        return Experience(batch, stats, timer, started, rollout.records)

    def update_policy(self, experience: Experience) -> dict:
        """PPO epochs over mini-batches for the critic, then the actor; returns the step's
        metrics (identical on every rank; 'reward' is the mean score). The policy's version
        (`step`, which seeds the next sampling) advances by one."""
        timer, batch = experience.timer, experience.batch
        updates = SumsAndCounts()
        skipped = False
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
        if "old_logprobs" not in batch:  # rollout.old_logprobs=update: the one mini-batch's
            batch["old_logprobs"] = mini_batch["old_logprobs"]
            self._old_logprob_statistics(batch, experience.stats)
        self.scheduler.policy_updated(self.step + 1, timer)
        metrics = derived_metrics(experience.stats.reduce(self.dp_group))
        metrics.update(updates.means())  # already global: every rank holds the same values
        metrics["training/padded_fraction"] = (metrics["actor/padded_tokens"]
                                               / max(metrics["actor/forward_tokens"], 1.0))
        metrics.update(timer.metrics())
        metrics.update(peak_memory_metrics())
        seconds = time.perf_counter() - experience.started
        metrics.update({"time/step": seconds, "reward": metrics["reward/mean"],
                        "throughput/tokens_per_second": metrics["throughput/tokens"] / seconds,
                        "training/update_skipped": float(skipped)})
        self.step += 1
        self.guards.check(self.step, metrics)
        return metrics

    def train_step(self) -> dict:
        """collect_data + update_policy on the sampler's next batch, then log, evaluate when
        due and save when due. The evaluation comes before the save, so that a checkpoint
        holds a step whose evaluation was logged: a run killed while evaluating redoes the
        step and its evaluation."""
        experience = self.collect_data()
        metrics = self.update_policy(experience)
        self.logger.log(self.step, metrics)
        self.timeline.record(self.step, experience.timer.intervals)
        self.trained_prompts.record(self.step, experience.prompts)
        if self._due(self.config.trainer.eval_every):
            self._evaluate_and_log(metrics)
        if self._due(self.config.trainer.save_every):
            self.save()
        if self._due(self.config.trainer.export_hf_every):
            print0(f"step {self.step}: exported the actor to {self.export_hf()}")
        return metrics

    def fit(self) -> list[dict]:
        """Train until trainer.total_steps (continuing a resumed run), evaluating before the
        first step, every trainer.eval_every steps and after the last; returns the metrics of
        the steps run here (none with trainer.val_only: one evaluation, then stop). Rank
        0 then draws the run's plots (trainer.plots)."""
        history = []
        total_steps = self.config.trainer.total_steps
        if self.config.trainer.val_only:  # the weights it starts from, resumed ones included
            self._evaluate_and_log()
            return history
        if self.config.trainer.eval_every and self.step == 0:
            self._evaluate_and_log()
        with progress(total=total_steps, initial=self.step, desc="train", unit="step") as bar:
            while self.step < total_steps and not self.selection.stopped:
                history.append(self.train_step())
                bar.update(1)
                if self.preemption.raised_anywhere():
                    self._save_for_requeue()
                    break
                if self.selection.stopped and self.step < total_steps:
                    self._stop_early()
        if self.config.trainer.plots and dist.get_rank() == 0:
            from mcore_rl.observability import plot_run
            paths = plot_run(self.config.runtime.output_dir)
            print0(f"plots: {', '.join(str(path) for path in paths)}")
        return history

    def evaluate(self) -> dict:
        """The evaluators' metrics on the validation prompts (see rl.evaluator; collective)."""
        return self.evaluator.evaluate(self, self.step)

    def _evaluate_and_log(self, step_metrics: dict | None = None) -> None:
        """Evaluate, check for signs of reward hacking (warned of on the console, logged as
        warnings/*), log the row and keep the policy if it is the best so far; `step_metrics`:
        the step's, whose KL to the reference stands in when the evaluation has none."""
        metrics = self.evaluate()
        warnings, message = self.hacking_monitor.check(
            metrics, (step_metrics or {}).get("actor/kl_to_reference"))
        metrics.update(warnings)
        if message:
            print0(f"WARNING step {self.step}: {message}")
        self.logger.log(self.step, metrics, "eval")
        self._keep_if_best(metrics)

    def register_evaluator(self, evaluator: Evaluator) -> None:
        """Run `evaluator.evaluate(trainer, samples)` at every evaluation (on every rank, with
        the samples of all ranks); its metrics are logged with an 'eval/' prefix."""
        self.evaluator.evaluators.append(evaluator)

    def export_hf(self, out_dir: str | None = None) -> str:
        """The actor as an HF folder, by default output_dir/hf/step_<N> (collective); with
        adapters, merged, and the adapters alone as a peft adapter in its adapter/ folder."""
        from mcore_rl.conversion.export import export_actor_to_hf
        from mcore_rl.conversion.peft_adapter import ADAPTER_DIR
        from mcore_rl.training.adapter_export import export_adapters

        out_dir = out_dir or os.path.join(self.config.runtime.output_dir, "hf",
                                          f"step_{self.step:08d}")
        export_actor_to_hf(self.config, self.roles.actor.parameters_for_sync(),
                           self.runtime.training, self.data.tokenizer, out_dir)
        export_adapters(self.roles.actor.module, self.config, os.path.join(out_dir, ADAPTER_DIR))
        return out_dir

    # -- pieces of the step ------------------------------------------------------------------
    def _old_logprob_statistics(self, batch: dict, stats: SumsAndCounts) -> None:
        old_logprob_statistics(batch, self.step, self.config.rollout.importance_correction(),
                               self.config.algorithm.kl_estimator, stats)

    def _balanced(self, batch: dict, stats: SumsAndCounts) -> dict:
        """The batch with rows moved between data-parallel ranks so that each holds about the
        same number of tokens for the update (groups and advantages are already computed)."""
        batch, balance = balance_over_data_parallel(batch, self.dp_group)
        for name, value in balance.items():  # identical on every rank: the mean is the value
            stats.add(name, torch.tensor([float(value)]))
        return batch

    def _due(self, every: int) -> bool:
        """Whether something done every `every` steps and after the last (0: never) is due
        (was done) after the current step: evaluations, saves, HF exports. The last step is
        trainer.total_steps, or the one whose evaluation stopped the run early."""
        return bool(every) and (self.step % every == 0 or self.selection.stopped
                                or self.step == self.config.trainer.total_steps)

    def _best_dir(self) -> str:
        """Where the best evaluated policy so far is kept (trainer.selection)."""
        return os.path.join(self.config.runtime.output_dir, "hf", "best")

    def _keep_if_best(self, metrics: dict) -> None:
        """Export the actor to output_dir/hf/best (and its step and value to hf/best.json) when
        this evaluation is the best so far by trainer.selection.metric (collective)."""
        if not self.selection.observe(self.step, metrics).improved:
            return
        best = self._best_dir()
        self.export_hf(best + ".incoming")
        if dist.get_rank() == 0:
            _replace_folder(best + ".incoming", best)
            write_text_atomically(best + ".json",
                                  json.dumps(self.selection.summary(), indent=1) + "\n")
        dist.barrier()
        print0(f"step {self.step}: best {self.selection.config.metric} so far "
               f"({self.selection.best_value:.4g}): the actor is kept in {best}")

    def _stop_early(self) -> None:
        """Say why the run ends here (train_step saved and exported it as the last step: a
        rerun resumes into the stopped state and ends)."""
        selection = self.selection
        print0(f"step {self.step}: stopping early: {selection.config.metric} has not improved "
               f"for {selection.config.patience} evaluations (best {selection.best_value:.4g} "
               f"at step {selection.best_step}, kept in {self._best_dir()})")

    # -- checkpoints ---------------------------------------------------------------------------

    def _save_for_requeue(self) -> None:
        if not self._due(self.config.trainer.save_every):
            self.save()
        self.preempted = True
        print0(f"step {self.step}: {self.config.trainer.save_signal} received; saved "
               f"{self.checkpoint_dir} and stopping (exit status {PREEMPTED_EXIT_CODE})")

    def _trained_models(self) -> dict:
        models = {"actor": self.roles.actor.trainable}
        if self.roles.critic is not None:
            models["critic"] = self.roles.critic.trainable
        return models

    def save(self) -> str:
        """Checkpoint everything a bitwise resume needs (collective)."""
        return checkpointer.save_training_state(
            self.checkpoint_dir, self.step, self._trained_models(), self.saved.state_dict(),
            to_yaml(self.config),
            self.config.trainer.keep_last, rank_state=self.scheduler.state_dict(),
            place=self.runtime.training)

    def _resume(self) -> None:
        loaded = checkpointer.load_latest_training_state(
            self.checkpoint_dir, self._trained_models(), place=self.runtime.training)
        if loaded is None:
            return
        self.step, state = loaded
        self.saved.load_state_dict(state)
        self.scheduler.load_state_dict(state["rank_state"])
        print0(f"resumed from step {self.step} ({self.checkpoint_dir})")

    def abandon(self, exit_code: int) -> None:
        """After an error on this rank: ask the rollout ranks of split placement to exit with
        `exit_code` instead of waiting for their timeout (no collective)."""
        self.scheduler.abandon(exit_code)

    def close(self) -> None:
        """Stop reward workers, the engine (or the rollout ranks, with this run's exit status)
        and TensorBoard, and leave the process group."""
        self.scheduler.close(PREEMPTED_EXIT_CODE if self.preempted else 0)
        self.logger.close()
        self.timeline.close()
        self.trained_prompts.close()
        shutdown()


def _colocated_rollouts(config: JobConfig, data, reward_fn, runtime: Runtime):
    """The roles and the rollout scheduler when every rank trains and generates: the engine on
    these ranks, the rule rewards on the first rank of each data shard's group (TP x CP x
    PP)."""
    shard_group = runtime.training.group("shard")
    reward_start = start_rule_reward(config, data, reward_fn, is_scorer=dist.get_rank()
                                     == dist.get_process_group_ranks(shard_group)[0])
    engine, weight_sync, roles = build_engine_and_roles(config, runtime, data.tokenizer)
    rule_reward = reward_start.result()
    parkings = [HostParking(role.trainable) for role, role_config in
                ((roles.actor, config.actor), (roles.critic, config.critic))
                if role is not None and role_config.offload]
    generator = PolicyGenerator(engine, weight_sync, roles.actor, parkings,
                                PromptConfig(max_prompt_tokens=config.data.max_prompt_tokens),
                                shard_group)
    scorer = Scorer(rule_reward, roles.reward_model, data.pad_id, shard_group)
    return roles, RolloutScheduler(config, data, generator, scorer,
                                   runtime.training.group("dp"),
                                   build_episode_runner(config, data))


def _same_run(config: JobConfig) -> bool:
    """Whether output_dir holds this very run, stopped before its first checkpoint (a killed or
    requeued job): it then starts again from step 0, appending to its own logs, whose readers
    keep the last line written for each step."""
    path = os.path.join(config.runtime.output_dir, "config.yaml")
    if not os.path.isfile(path):
        return False
    with open(path) as handle:
        return handle.read() == to_yaml(config)


def _replace_folder(source: str, target: str) -> None:
    """Move `source` to `target`, replacing it. Between the two renames the previous target
    sits at `target.old` (a kill there leaves it for a reader; the next replacement removes
    it first)."""
    shutil.rmtree(target + ".old", ignore_errors=True)
    if os.path.exists(target):
        os.replace(target, target + ".old")
    os.replace(source, target)
    shutil.rmtree(target + ".old", ignore_errors=True)


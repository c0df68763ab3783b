"""Building the roles, the engine and its weight sync from one job config, on every rank.

Which roles exist follows from the algorithm: a critic when the estimator needs values, a
reference when a KL term is used. The reference starts as an exact copy of the actor's initial
weights (also for random initialisation), so KL to the reference is 0 at step 0.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mcore_rl.agents import (ChatFormat, EpisodeRunner, EpisodeSpec, environment_class,
                             function_tools, tool_schemas)
from mcore_rl.algorithms import unregistered_names
from mcore_rl.checkpoint.base_identity import base_identity
from mcore_rl.config import ConfigError, InitConfig, JobConfig, validate_rl
from mcore_rl.config.job import own_old_logprob_blockers
from mcore_rl.config.parallel import AUTO_ORDER
from mcore_rl.conversion.export import hf_architecture
from mcore_rl.conversion.model_source import with_model_from_init
from mcore_rl.models import DTYPES, build_gpt_model
from mcore_rl.models.pretrained import build_from_init, copy_of_stage
from mcore_rl.observability.startup import STARTUP
from mcore_rl.resharding import DeltaOptions, Resharder, build_plan, make_rollout_layout
from mcore_rl.resharding.execute import megatron_training_layout
from mcore_rl.resharding.layouts import DEFAULT_ORDER, TrainingLayout, layout_order
from mcore_rl.resharding.plan import ReshardPlan
from mcore_rl.resharding.rank_order import choose_training_order
from mcore_rl.rewards import FunctionTable, RuleRewards
from mcore_rl.roles import Actor, Critic, Reference, RewardModel, RuleReward, Teacher
from mcore_rl.runtime import LaunchEnv, Runtime, print0, seed_everything
from mcore_rl.runtime.agreement import raise_on_any_rank
from mcore_rl.runtime.transport import Transport
from mcore_rl.rollout import MegatronEngine, RolloutEngine
from mcore_rl.training import make_trainable

from .api import with_actor_model
from .data import TrainingData
from .distillation import build_teacher
from .job_rewards import reward_config
from .weight_sync import WeightSync


@dataclass
class Roles:
    """The models of one RL job on this rank."""

    actor: Actor
    critic: Critic | None
    reference: Reference | None
    reward_model: RewardModel | None
    teacher: Teacher | None = None

    @property
    def scorers(self) -> list:
        """The frozen passes over each batch before the update (reference, teacher, critic's
        old values), each writing its declared `batch_key`."""
        return [role for role in (self.reference, self.teacher, self.critic) if role is not None]


OLD_LOGPROB_PASSES = {"update": "the update's own forward pass (no pass before it)",
                      "trainer": "an actor forward pass before the update",
                      "engine": "the engine's sampling log-probs"}


def say_old_logprob_source(config: JobConfig) -> None:
    """Print once where the PPO ratio's old log-probs come from, and why auto chose a pass
    before the update."""
    source = config.old_logprob_source()
    why = ""
    if config.rollout.old_logprobs == "auto" and source == "trainer":
        why = ": " + "; ".join(own_old_logprob_blockers(config))
    print0(f"rollout.old_logprobs={config.rollout.old_logprobs}: old log-probs from "
           f"{OLD_LOGPROB_PASSES[source]}{why}")


def build_roles(config: JobConfig, runtime: Runtime, tokenizer=None) -> Roles:
    """Actor (+ critic, + reference, + teacher) with their starting weights from `config.init`
    (the teacher's from teacher.init, checked against the student's `tokenizer`), on the
    runtime's device at its place in the trained models' layout. An actor with adapters is its
    own reference (adapters off): no second model is built."""
    precision, temperature = config.runtime.precision, config.rollout.sampling.temperature
    device, place = runtime.device, runtime.training
    with STARTUP.phase("actor_build_and_load"):
        policy = build_from_init(config.init, config.model, config.parallel, precision, "lm",
                                 device, config.actor.lora, config.runtime.seed, place=place)
    reference = None
    if config.algorithm.needs_reference:
        with STARTUP.phase("reference_copy"):
            frozen = policy if config.actor.lora.enabled else copy_of_stage(
                policy, config.model, config.parallel, precision, device)
        reference = Reference(frozen, config.model.vocab_size, config.actor.micro_batch_size,
                              temperature, config.reference.offload,
                              config.micro_batch_tokens("actor"), config.model,
                              config.rollout.routing_replay)
    lora = config.actor.lora
    base = base_identity(config.init, config.runtime.seed, lora) if lora.enabled else None
    with STARTUP.phase("optimizer"):
        trainable = make_trainable(policy, config.actor.optimizer, precision, base)
    actor = Actor(trainable, config.model.vocab_size, config.actor.micro_batch_size,
                  config.algorithm, temperature, config.rollout.importance_correction(),
                  config.micro_batch_tokens("actor"), config.model,
                  config.rollout.routing_replay)
    critic = None
    if config.algorithm.needs_critic:
        value_model = build_from_init(critic_init(config), config.model, config.parallel,
                                      precision, "scalar", device, place=place)
        critic = Critic(make_trainable(value_model, config.critic.optimizer, precision),
                        config.critic.micro_batch_size, config.algorithm,
                        config.micro_batch_tokens("critic"))
    say_old_logprob_source(config)
    reward_model = None
    if config.reward.model_path:
        reward_model = build_reward_model(config, runtime)
    teacher = build_teacher(config, tokenizer, runtime) if config.teacher.enabled else None
    return Roles(actor, critic, reference, reward_model, teacher)


def start_rule_reward(config: JobConfig, data: TrainingData, reward_fn, is_scorer: bool
                      ) -> "RuleRewardStart":
    """The rule rewards on the ranks that score (the first of each model-parallel group), after
    checking on every rank that each data source has a reward function (collective), their
    probe on real rows started (`RuleReward.probe`); `result()` waits for it. With a reward
    model they only check answers against the ground truth, and only where every row has one
    and every data source a rule (`ground_truth_checked`); else None. reward_fn: see
    `Trainer`."""
    with STARTUP.phase("rule_reward"):
        reward, problems = None, []
        if config.reward.model_path and not ground_truth_checked(config, data, reward_fn):
            return RuleRewardStart(None)
        if is_scorer:
            try:
                rewards = RuleRewards(reward_config(config), reward_fn)
                reward = RuleReward(rewards, data.tokenizer)
                rewards.check_data_sources({r.data_source
                                            for r in data.records + data.validation})
            except ValueError as error:
                problems.append(str(error))
        raise_on_any_rank(problems, ConfigError, "reward: ")
        return RuleRewardStart(reward, data.records + data.validation)


class RuleRewardStart:
    """Rule rewards whose probe runs in a thread of this rank while it starts the rest: the
    probe waits on the reward workers, which import the functions' libraries (reasoning-gym's
    import takes about 3 s) on a core of their own. Nothing else uses the rewards before
    `result()`."""

    def __init__(self, reward: RuleReward | None, rows: list = ()):
        self._reward = reward
        self._failure: list[str] = []
        self._probe = None
        if reward is not None:
            self._probe = threading.Thread(target=self._run_probe, args=(list(rows),),
                                           name="reward-probe", daemon=True)
            self._probe.start()

    def _run_probe(self, rows: list) -> None:
        try:
            self._reward.probe(rows)
        except ValueError as error:  # raised by result(), on every rank together
            self._failure.append(str(error))
        except Exception as error:
            self._failure.append(f"{type(error).__name__}: {error}")

    def result(self) -> RuleReward | None:
        """The rule rewards once their probe has passed on every rank (collective);
        ConfigError naming the rows that failed otherwise."""
        with STARTUP.phase("rule_reward_probe"):
            if self._probe is not None:
                self._probe.join()
            raise_on_any_rank(self._failure, ConfigError, "reward: ")
        return self._reward


def build_episode_runner(config: JobConfig, data: TrainingData
                         ) -> EpisodeRunner | "AgentRunner" | None:
    """Multi-turn rollouts' runner (None for single-turn jobs): the agent's (an OpenAI
    endpoint per rank) or the environment's, after checking on every rank that the agent, or
    the environment and its tools, and the chat template can be used (collective)."""
    multi_turn = config.rollout.multi_turn
    if not multi_turn.enabled:
        return None
    runner, problems = None, []
    try:
        if multi_turn.agent:  # imported here: only agents need fastapi and uvicorn
            from mcore_rl.agents.agent_runner import AgentRunner
            runner = AgentRunner.build(multi_turn, data.tokenizer)
        else:
            runner = _environment_runner(multi_turn, data)
    except ValueError as error:
        problems.append(str(error))
    raise_on_any_rank(problems, ConfigError, "rollout.multi_turn: ")
    return runner


def _environment_runner(multi_turn, data: TrainingData) -> EpisodeRunner:
    """The EpisodeRunner of the configured environment and tools."""
    spec = EpisodeSpec(multi_turn.environment, tuple(multi_turn.tools),
                       multi_turn.tool_parser, multi_turn.python_timeout_seconds,
                       multi_turn.sandbox.memory_mb)
    schemas = tool_schemas(environment_class(spec.environment), function_tools(spec.tools))
    chat = ChatFormat(data.tokenizer, schemas, dict(multi_turn.template_kwargs))
    return EpisodeRunner.build(multi_turn, chat, spec,
                               probe_record=(data.records + data.validation or [None])[0])


def ground_truth_checked(config: JobConfig, data: TrainingData, reward_fn) -> bool:
    """Whether a reward model's job can also check answers: every training and validation row
    carries a ground truth and every data source has a rule (or `reward_fn` scores them all).
    Said on rank 0 when it cannot (no accuracy is logged then)."""
    records, table = data.records + data.validation, FunctionTable.from_config(config.reward)
    missing = sum(record.ground_truth is None for record in records)
    unknown = [] if reward_fn else sorted({record.data_source for record in records
                                           if table.path_for(record.data_source) is None})
    if missing or unknown:
        print0(f"reward.model_path: answers are not checked against a ground truth "
               f"({missing} rows without one, data sources without a rule: {unknown or 'none'})"
               f"; no reward/accuracy or eval/accuracy is logged")
    return not (missing or unknown)


def build_reward_model(config: JobConfig, runtime: Runtime) -> RewardModel:
    """The frozen reward model from reward.model_path (an HF sequence classifier). Without a
    missing-EOS penalty rank 0 says once that cut-off responses are scored as complete ones."""
    if not config.reward.shaping.missing_eos_penalty:
        print0("reward.model_path: responses cut off at rollout.sampling.max_new_tokens are "
               "scored as if complete (a reward model trained on complete answers can rate "
               "them highest); reward.shaping.missing_eos_penalty penalises them "
               "(docs/preference.md)")
    from mcore_rl.conversion.sequence_classifier import (open_sequence_classifier,
                                                         scalar_shards_from_hf)
    from mcore_rl.models.weights import copy_into_stage

    path = config.reward.model_path
    try:
        hf, arch, model = open_sequence_classifier(path)
    except (OSError, ValueError) as error:
        raise ConfigError(f"reward.model_path: {error}") from error
    problems = model.check(config.parallel.tensor_model_parallel_size,
                           config.parallel.pipeline_model_parallel_size)
    if model.vocab_size != config.model.vocab_size:
        problems.append(f"its vocabulary ({model.vocab_size}) is not the policy's "
                        f"({config.model.vocab_size}); the reward model must share the tokenizer")
    if problems:
        raise ConfigError(f"reward.model_path={path}: " + "; ".join(problems))
    module = build_gpt_model(model, config.parallel, config.runtime.precision, "scalar",
                             runtime.device, random_init=False, place=runtime.training)
    with torch.no_grad():
        copy_into_stage(module, scalar_shards_from_hf(hf, arch, model, runtime.training))
    return RewardModel(module, config.actor.micro_batch_size)


def critic_init(config: JobConfig) -> InitConfig:
    """The critic's starting weights: critic.init_path (HF folder or mcore_rl checkpoint, told
    apart by config.json), else the actor's."""
    path = config.critic.init_path
    return InitConfig.from_path(path) if path else config.init


def settled_config(config: JobConfig, launch: LaunchEnv, actor_model: str | None = None,
                   critic_model: str | None = None) -> JobConfig:
    """The job's config with the starting models applied (HF folders or mcore_rl checkpoints
    overriding init / critic.init_path), the model read from them, every rule checked and the
    rank order chosen: what every rank of the job (either side in split placement) runs with."""
    if actor_model is not None:
        config = with_actor_model(config, actor_model)
    if critic_model is not None:
        config = dataclasses.replace(config, critic=dataclasses.replace(
            config.critic, init_path=critic_model))
    config = with_model_from_init(config)
    config = validate_rl(config, launch.world_size, unregistered_names(config.algorithm))
    trainers = config.placement.trainer_ranks(launch.world_size)
    return with_rank_order(config, min(launch.ranks_per_node, trainers), trainers)


def with_rank_order(config: JobConfig, ranks_per_node: int, world_size: int) -> JobConfig:
    """The config with parallel.rank_order settled: `auto` is, for a job generating with vLLM,
    the order that moves the fewest bytes into vLLM's tensor-parallel groups
    (`resharding.rank_order`), and Megatron's default otherwise (also in split placement, where
    no rank holds both a training shard and an engine shard)."""
    parallel = config.parallel
    if parallel.rank_order != AUTO_ORDER:
        return config
    order = DEFAULT_ORDER
    if config.rollout.engine == "vllm" and not config.placement.split:
        tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
        order = choose_training_order(config.model, tp, pp, world_size // (tp * pp),
                                      config.rollout.rollout_tp, ranks_per_node,
                                      parallel.expert_model_parallel_size,
                                      parallel.expert_tensor_parallel_size,
                                      config.rollout.expert_parallel)
    return dataclasses.replace(config, parallel=dataclasses.replace(
        parallel, rank_order="-".join(order)))


def build_engine_and_roles(config: JobConfig, runtime: Runtime, tokenizer=None
                           ) -> tuple[RolloutEngine, WeightSync | None, Roles]:
    """The rollout engine, the weight sync that feeds it (None when it generates on the actor's
    own parameters) and the roles. vLLM starts first: it needs its share of the GPU
    (rollout.gpu_memory_utilization) free at start-up, and it sleeps at once, so the roles
    get that memory back until the first generate. The Megatron engine comes after, on the
    actor's module."""
    length = config.sequence_length()
    if config.rollout.engine == "vllm":
        with STARTUP.phase("engine_start"):
            training = megatron_training_layout(config.model, runtime.training)
            engine, weight_sync = build_vllm_engine(config, length,
                                                    weight_plan(config, training),
                                                    data_shard=runtime.training.dp_rank)
            engine.sleep()
        # vLLM seeds torch with its own per-instance seed: reseed, or randomly initialised
        # data-parallel replicas would start from different weights.
        seed_everything(config.runtime.seed)
        return engine, weight_sync, build_roles(config, runtime, tokenizer)
    roles = build_roles(config, runtime, tokenizer)
    engine = MegatronEngine(roles.actor.module, config.model, length, seed=config.runtime.seed)
    return engine, None, roles


def training_layout(config: JobConfig, job_world_size: int) -> TrainingLayout:
    """The training layout the settled config describes (over the trainer ranks in split
    placement), without Megatron's parallel state: what the rollout ranks plan with."""
    parallel = config.parallel
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    trainers = config.placement.trainer_ranks(job_world_size)
    return TrainingLayout(config.model, tp, pp, trainers // (tp * pp),
                          layout_order(parallel.megatron_order()),
                          parallel.expert_model_parallel_size,
                          parallel.expert_tensor_parallel_size)


def weight_plan(config: JobConfig, training: TrainingLayout,
                weight_layout: str = "vllm") -> ReshardPlan:
    """The resharding plan from `training` to the engine's layout: over the same ranks when
    colocated, over the rollout ranks after the trainers in split placement."""
    moe_layout = hf_architecture(config).moe
    rollout = make_rollout_layout(training, weight_layout, config.rollout.rollout_tp,
                                  rollout_ranks=config.placement.rollout_ranks,
                                  moe_block=moe_layout.block if moe_layout else "mlp",
                                  expert_parallel=config.rollout.expert_parallel)
    return build_plan(training, rollout, DTYPES[config.runtime.precision])


def build_resharder(config: JobConfig, plan: ReshardPlan,
                    transport: Transport | None = None) -> Resharder:
    """The resharder of the actor's weight syncs, whole or delta (rollout.delta_sync), on
    both sides of `transport`."""
    rollout = config.rollout
    delta = None
    if rollout.delta_sync:
        delta = DeltaOptions(rollout.delta_sync_anchor_every, rollout.delta_sync_verify)
        print0(f"weight sync: delta messages (a whole sync every {delta.anchor_every}, "
               f"checksums {'verified' if delta.verify else 'off'}): reshard/delta_share shows "
               "the share of the lower bound sent")
    return Resharder(plan, rollout.sync_bucket_mb * 2 ** 20, transport, delta)


def _running_sequences(config: JobConfig) -> int | None:
    """The most sequences one engine instance runs at once in colocated placement: its part of
    a step's prompts x n (the KV cache is sized for them on CPUs; an evaluation's larger calls
    queue). None in split placement, whose engines keep batches of several versions in flight,
    and for vLLM's expert parallelism over data-parallel instances: an instance left idle
    while another still queues runs dummy steps, which the route capture misreads."""
    if config.placement.split or config.rollout.expert_parallel:
        return None
    instances = config.engine_instances(dist.get_world_size())
    return -(-config.rollout.prompts_per_step // instances) * config.rollout.sampling.n


def build_vllm_engine(config: JobConfig, context: int, plan: ReshardPlan,
                      transport: Transport | None = None, data_shard: int | None = None):
    """A vLLM engine (awake) for sequences of `context` tokens over this side's world, serving
    the plan's rollout layout (colocated: on ranks bringing the prompts of training data shard
    `data_shard`), and the weight sync feeding it its shards of `plan` (through `transport`:
    the bridge in split placement), after the engine has checked the plan's
    shards against its parameters (on every rank together, before any byte moves). A plan to
    the ``full`` layout is the diagnostic form (full tensors to every rank) benchmarks compare
    against."""
    from mcore_rl.rollout.vllm_engine import VllmEngine
    from mcore_rl.rollout.vllm_start import VllmOptions, write_config_folder

    architecture = hf_architecture(config)
    folder = os.path.join(config.runtime.output_dir, "engine_config")
    if dist.get_rank() == 0:
        write_config_folder(config.model, architecture, folder)
    dist.barrier()
    rollout = config.rollout
    engine = VllmEngine(folder, architecture, plan.rollout, context, VllmOptions(
        dtype=plan.dtype, seed=config.runtime.seed,
        gpu_memory_utilization=rollout.gpu_memory_utilization, cuda_graphs=rollout.cuda_graphs,
        sleep_level=rollout.sleep_level,
        timeout_minutes=config.runtime.collective_timeout_minutes,
        capture_routes=rollout.captures_routes, prefix_caching=rollout.prefix_caching,
        full_logprobs=rollout.vllm_raw_logprobs, max_num_seqs=_running_sequences(config)),
        data_shard)
    resharder = build_resharder(config, plan, transport)
    if plan.rollout.engine == "vllm":
        engine.check_plan(plan.wanted_shapes(resharder.rank), plan.dtype)
    return engine, WeightSync(resharder, engine)

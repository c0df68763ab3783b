"""The root configuration of one mcore_rl job and its single validation entry point."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterable

from .algorithm import AlgorithmConfig
from .data import CHAT_TEMPLATE_MODES, DataConfig
from .model import InitConfig, ModelConfig
from .parallel import ParallelConfig
from .placement import PlacementConfig
from .preference import DpoConfig, RmConfig
from .reward import RewardConfig
from .lora import LoraConfig
from .rl import (ActorConfig, CriticConfig, ReferenceConfig, RolloutConfig, TrainerConfig,
                 rollout_tp_errors)
from .runtime import RuntimeConfig
from .sft import SftConfig
from .teacher import TeacherConfig
from .training import BatchConfig, OptimizerConfig


class ConfigError(ValueError):
    """A configuration that breaks one or more rules; the message lists every broken rule."""


@dataclass(frozen=True)
class SmokeConfig:
    """The distributed forward/backward smoke job (`mcore-rl smoke`)."""

    steps: int = 3
    """Optimizer steps to run on random tokens."""


@dataclass(frozen=True)
class JobConfig:
    """Everything one job needs; every rank builds the same one from the same YAML and overrides."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Architecture of the trained model."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Training layout over the world (over the trainer ranks in split placement)."""

    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """RL: colocated, or split into trainer ranks and rollout ranks."""

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and learning-rate schedule."""

    batch: BatchConfig = field(default_factory=BatchConfig)
    """Global and micro batch sizes and sequence length."""

    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    """Backend, precision, seeds, timeouts and output directory."""

    init: InitConfig = field(default_factory=InitConfig)
    """Starting weights (and with them the architecture)."""

    smoke: SmokeConfig = field(default_factory=SmokeConfig)
    """Settings of the smoke job."""

    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """RL: advantage estimator, losses, KL (`mcore-rl train`)."""

    actor: ActorConfig = field(default_factory=ActorConfig)
    """RL: the trained policy's optimizer and micro-batch size."""

    critic: CriticConfig = field(default_factory=lambda: CriticConfig(
        optimizer=OptimizerConfig(lr=1e-4)))
    """RL: the value model (built only for estimators that need one, e.g. gae); its default LR
    is ten times the actor's."""

    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    """RL: the frozen reference policy (built only when a KL term is used)."""

    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """RL: on-policy distillation from a frozen teacher (docs/distillation.md); off unless
    teacher.init names one."""

    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """RL: the engine and how responses are sampled."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """RL: steps, epochs, mini-batches, evaluation and checkpoints."""

    data: DataConfig = field(default_factory=DataConfig)
    """RL: prompt datasets, their encoding and order."""

    reward: RewardConfig = field(default_factory=RewardConfig)
    """RL: rule-based reward functions and their sandbox."""

    sft: SftConfig = field(default_factory=SftConfig)
    """Supervised fine-tuning on demonstrations (`mcore-rl sft`)."""

    rm: RmConfig = field(default_factory=lambda: RmConfig(optimizer=OptimizerConfig(lr=1e-5)))
    """Reward-model training on preference pairs (`mcore-rl rm`)."""

    dpo: DpoConfig = field(default_factory=lambda: DpoConfig(optimizer=OptimizerConfig(lr=1e-6)))
    """Direct preference optimisation on preference pairs (`mcore-rl dpo`)."""

    def sequence_length(self) -> int:
        """The longest RL sequence: a prompt (data.max_prompt_tokens) and its response
        (rollout.sampling.max_new_tokens), or a whole multi-turn episode
        (rollout.multi_turn.max_episode_tokens)."""
        if self.rollout.multi_turn.enabled:
            return self.rollout.multi_turn.max_episode_tokens
        return self.data.max_prompt_tokens + self.rollout.sampling.max_new_tokens

    def micro_batch_tokens(self, role: str) -> int:
        """The token budget of a trained role's micro-batches (actor, critic; 0: fixed rows):
        max_tokens_per_micro_batch with -1 resolved to micro_batch_size x the longest
        sequence, or to fixed rows where Megatron's allgather token dispatcher refuses
        micro-batches of varying length."""
        section = getattr(self, role)
        if section.max_tokens_per_micro_batch >= 0:
            return section.max_tokens_per_micro_batch
        if self.model.moe.enabled and self.parallel.moe_token_dispatcher == "allgather":
            return 0
        return section.micro_batch_size * self.sequence_length()

    def old_logprob_source(self) -> str:
        """rollout.old_logprobs with auto resolved: update where the update's own forward pass
        can give them (`own_old_logprob_blockers` empty), trainer elsewhere."""
        if self.rollout.old_logprobs != "auto":
            return self.rollout.old_logprobs
        return "trainer" if own_old_logprob_blockers(self) else "update"


def own_old_logprob_blockers(config: JobConfig) -> list[str]:
    """Why the update's forward pass cannot give the old log-probs: the batch takes more than
    one optimizer step (later steps need the policy before the first), or something reads
    them before the update."""
    trainer, algorithm = config.trainer, config.algorithm
    blockers = []
    if (trainer.ppo_epochs, trainer.mini_batches) != (1, 1):
        blockers.append(f"a batch takes more than one optimizer step (trainer.ppo_epochs="
                        f"{trainer.ppo_epochs}, trainer.mini_batches={trainer.mini_batches})")
    readers = {"algorithm.use_kl_in_reward (the KL penalty in the rewards)":
               algorithm.use_kl_in_reward,
               "a teacher (distillation's advantage)": config.teacher.enabled,
               "rollout.routing_replay=r2 (the routes of the old-log-prob pass)":
               config.rollout.routing_replay == "r2",
               "a Mixture-of-Experts model (its routing metrics)": config.model.moe.enabled}
    blockers += [f"{reader} reads them before the update"
                 for reader, reads in readers.items() if reads]
    return blockers


def validate(config: JobConfig, world_size: int) -> JobConfig:
    """Check every rule that can be checked before a process group exists; raise ConfigError
    listing all broken ones (not just the first). Returns the config with its machine-dependent
    settings settled (`runtime.precision=auto`), as the job runs and records it. In split
    placement the training layout spans the trainer ranks only."""
    parallel = config.parallel
    errors = config.placement.errors(world_size)
    training_world = config.placement.trainer_ranks(world_size) if not errors else world_size
    errors += parallel.check(training_world, f"the {training_world} trainer ranks (world size "
                             f"{world_size} less placement.rollout_ranks)"
                             if training_world != world_size else "")
    errors += config.model.check(parallel.tensor_model_parallel_size,
                                 parallel.pipeline_model_parallel_size,
                                 parallel.expert_model_parallel_size,
                                 parallel.expert_tensor_parallel)
    errors += config.optimizer.check("optimizer")
    errors += config.runtime.check()
    if not errors:
        errors += config.batch.check(parallel.data_parallel_size(training_world))
        if config.batch.seq_length > config.model.max_position_embeddings:
            errors.append(f"batch.seq_length={config.batch.seq_length} exceeds "
                          f"model.max_position_embeddings={config.model.max_position_embeddings}")
    if config.init.hf_path and config.init.checkpoint:
        errors.append("set at most one of init.hf_path and init.checkpoint")
    if config.smoke.steps < 1:
        errors.append(f"smoke.steps={config.smoke.steps} must be >= 1")
    if config.trainer.console_every < 1:
        errors.append(f"trainer.console_every={config.trainer.console_every} must be >= 1")
    if not errors:
        errors += _moe_tensor_parallel_errors(config) + _context_parallel_errors(config)
    if errors:
        raise ConfigError("invalid configuration (world size %d):\n  - %s"
                          % (world_size, "\n  - ".join(errors)))
    return dataclasses.replace(config, runtime=config.runtime.resolved())


def _moe_tensor_parallel_errors(config: JobConfig) -> list[str]:
    """Megatron's MoE layer at TP > 1. (The experts against EP: ModelConfig.check; EP against
    the data-parallel size: ParallelConfig.check.)"""
    parallel = config.parallel
    if config.model.moe.enabled and parallel.tensor_model_parallel_size > 1 \
            and not parallel.sequence_parallel:
        return ["a Mixture-of-Experts model at tensor_model_parallel_size > 1 trains only "
                "with parallel.sequence_parallel=true (Megatron's MoE layer)"]
    return []


def _context_parallel_errors(config: JobConfig) -> list[str]:
    """What context parallelism cannot be combined with yet (models/context_parallel.py)."""
    cp = config.parallel.context_parallel_size
    if cp == 1:
        return []
    unsupported = {
        "rollout.engine=megatron (it generates on the actor's parameters without CP; use "
        "vllm)": config.rollout.engine == "megatron",
        "teacher.enabled (a teacher's own layout has no CP)": config.teacher.enabled,
        "placement.rollout_ranks > 0 (split placement hands rows to data-parallel ranks; "
        "CP runs colocated)": config.placement.split,
    }
    return [f"parallel.context_parallel_size={cp} is not supported with {what}"
            for what, present in unsupported.items() if present]


MOE_DATASET_JOBS = ("sft", "dpo", "rm")
"""Dataset jobs run end to end on Mixture-of-Experts models (docs/moe.md)."""


def moe_job_errors(config: JobConfig, job: str) -> list[str]:
    """Jobs that cannot train Mixture-of-Experts models yet: the smoke test and the dataset
    jobs other than MOE_DATASET_JOBS (RL has its own rules, `_moe_rl_errors`)."""
    moe = config.model.moe
    if not moe.enabled or job in MOE_DATASET_JOBS:
        return []
    return [f"model.moe.num_experts={moe.num_experts}: the {job} job does not train "
            "Mixture-of-Experts models yet (RL, SFT, DPO and RM do; docs/moe.md)"]


def lora_errors(config: JobConfig, lora: LoraConfig, prefix: str) -> list[str]:
    """The adapter settings at `prefix` and what they cannot be combined with yet."""
    errors = lora.errors(prefix) + lora.model_errors(prefix, config.model)
    if lora.enabled and lora.dropout and config.parallel.tensor_model_parallel_size > 1:
        errors.append(f"{prefix}.dropout={lora.dropout} with parallel.tensor_model_parallel_size"
                      f"={config.parallel.tensor_model_parallel_size} is not supported yet: the "
                      "adapters' dropout masks are not verified to agree across TP ranks")
    return errors


def _rollout_expert_parallel_errors(config: JobConfig, engine_ranks: int) -> list[str]:
    """vLLM's expert parallelism splits the experts, whole, over all the engine's ranks (its
    data x tensor-parallel ranks)."""
    experts = config.model.moe.num_experts
    if config.rollout.engine != "vllm":
        return [f"rollout.expert_parallel=true is vLLM's expert parallelism: needs "
                f"rollout.engine=vllm, not {config.rollout.engine!r}"]
    if experts % engine_ranks:
        return [f"rollout.expert_parallel=true: model.moe.num_experts={experts} must be "
                f"divisible by the engine's {engine_ranks} ranks (data x tensor-parallel: "
                f"rollout.rollout_tp={config.rollout.rollout_tp})"]
    return []


def _moe_rl_errors(config: JobConfig, world_size: int) -> list[str]:
    """What an RL job on a Mixture-of-Experts model cannot do yet. With experts split over
    ranks, every forward pass exchanges tokens among the EP ranks, so they must run the same
    number of them: generating on the actor (responses of different lengths) would leave one
    waiting (token-budget micro-batches are evened out with fillers). Without expert
    parallelism vLLM splits each expert over all its data x tensor-parallel ranks, not over
    one engine's TP ranks as the weight sync plans it (seen as mismatched shapes at the first
    sync)."""
    replay = config.rollout.routing_replay
    if not config.model.moe.enabled:
        return [f"rollout.{field}={value} needs a Mixture-of-Experts model (model.moe."
                "num_experts > 0)" for field, value in (("routing_replay", replay),
                                                         ("expert_parallel", "true"),
                                                         ("router_agreement", "true"))
                if getattr(config.rollout, field) not in ("none", False)]
    errors = []
    if config.rollout.router_agreement and config.rollout.engine != "vllm":
        errors.append("rollout.router_agreement compares the trainer's routers with the vLLM "
                      "engine's: needs rollout.engine=vllm")
    if replay == "r3" and config.rollout.engine != "vllm":
        errors.append("rollout.routing_replay=r3 replays the vLLM engine's routes: needs "
                      "rollout.engine=vllm")
    engine_ranks = config.placement.engine_ranks(world_size)
    if config.rollout.engine == "vllm" and engine_ranks > config.rollout.rollout_tp \
            and not config.rollout.expert_parallel:
        errors.append(f"rollout.rollout_tp={config.rollout.rollout_tp} on {engine_ranks} ranks: "
                      "without expert parallelism vLLM splits each expert over all its data x "
                      "tensor-parallel ranks, which the weight sync does not plan; set "
                      "rollout.expert_parallel=true (each rank serves whole experts) or "
                      "rollout.rollout_tp to the number of ranks (docs/moe.md)")
    if config.rollout.expert_parallel:
        errors += _rollout_expert_parallel_errors(config, engine_ranks)
    if config.parallel.expert_model_parallel_size > 1:
        if config.rollout.engine != "vllm":
            errors.append(f"rollout.engine={config.rollout.engine!r} generates on the actor, "
                          "where ranks with experts split (parallel.expert_model_parallel_size "
                          "> 1) run different numbers of forward passes: use rollout.engine="
                          "vllm")
    if config.parallel.moe_token_dispatcher == "allgather":
        for role in ("actor", "critic") if config.algorithm.needs_critic else ("actor",):
            if getattr(config, role).max_tokens_per_micro_batch > 0:
                errors.append(f"{role}.max_tokens_per_micro_batch (micro-batches of varying "
                              "length) is refused by Megatron's allgather token dispatcher: "
                              "use parallel.moe_token_dispatcher=alltoall")
    return errors


def validate_rl(config: JobConfig, world_size: int, name_errors: Iterable[str] = ()) -> JobConfig:
    """`validate` plus the rules of an RL job (roles, rollout, batch arithmetic). name_errors:
    what the registries above config found (`algorithms.unregistered_names`), reported with
    the rest."""
    config = validate(config, world_size)
    errors = config.algorithm.errors() + config.rollout.errors() + config.trainer.errors()
    errors += config.data.errors() + config.reward.errors()
    errors += config.actor.optimizer.check("actor.optimizer")
    errors += config.critic.optimizer.check("critic.optimizer")
    errors += _rl_batch_errors(config, world_size) + list(name_errors)
    errors += _moe_rl_errors(config, world_size)
    errors += _old_logprob_errors(config)
    if config.rollout.importance_cap:
        errors += _truncated_logprob_errors(
            config.rollout, f"rollout.importance_cap={config.rollout.importance_cap}",
            "the importance weight needs", "rollout.importance_cap=0")
    errors += lora_errors(config, config.actor.lora, "actor.lora")
    errors += _teacher_errors(config, world_size)
    if config.reward.shaping.active and config.algorithm.estimator == "remax":
        errors.append("reward.shaping cannot be combined with algorithm.estimator=remax: its "
                      "greedy baseline is scored without the shaping")
    length = config.sequence_length()
    if length > config.model.max_position_embeddings:
        errors.append(f"{_sequence_length_fields(config)} = {length} exceeds "
                      f"model.max_position_embeddings={config.model.max_position_embeddings}")
    if config.rollout.engine == "vllm":
        errors += [f"rollout.{message}" for message in rollout_tp_errors(
            config.rollout.rollout_tp, config.placement.engine_ranks(world_size),
            config.model.num_attention_heads)]
    for role in ("actor", "critic"):
        if getattr(config, role).offload and config.rollout.engine != "vllm":
            errors.append(f"{role}.offload=true needs rollout.engine=vllm (the "
                          f"{config.rollout.engine} engine generates with the actor's own "
                          f"parameters)")
    errors += _placement_errors(config, world_size)
    if errors:
        raise ConfigError("invalid RL configuration (world size %d):\n  - %s"
                          % (world_size, "\n  - ".join(errors)))
    return config


def _teacher_errors(config: JobConfig, world_size: int) -> list[str]:
    """The teacher's rules, over the ranks that train (the teacher lives on the trainer side of
    split placement, never on the rollout ranks)."""
    if not config.teacher.enabled:
        return []
    trainers = config.placement.trainer_ranks(world_size)
    where = "ranks" if not config.placement.split else (
        f"trainer ranks (placement.rollout_ranks={config.placement.rollout_ranks} only "
        f"generate)")
    parallel = config.parallel
    return config.teacher.errors(parallel.tensor_model_parallel_size,
                                 parallel.pipeline_model_parallel_size, trainers, where)


def _sequence_length_fields(config: JobConfig) -> str:
    """The fields JobConfig.sequence_length adds up, for messages."""
    if config.rollout.multi_turn.enabled:
        return "rollout.multi_turn.max_episode_tokens"
    return "data.max_prompt_tokens + rollout.sampling.max_new_tokens"


def _placement_errors(config: JobConfig, world_size: int) -> list[str]:
    """What split placement does not combine with (yet), and staleness outside it."""
    rollout, placement = config.rollout, config.placement
    if not placement.split:
        return ([f"rollout.max_staleness={rollout.max_staleness} needs split placement "
                 "(placement.rollout_ranks > 0); colocated jobs lag one step with "
                 "rollout.async_rollout"] if rollout.max_staleness else [])
    why = "with placement.rollout_ranks > 0 (split placement)"
    errors = []
    if rollout.engine != "vllm":
        errors.append(f"rollout.engine={rollout.engine!r} cannot run {why}: the rollout ranks "
                      "hold no actor to generate with; use rollout.engine=vllm")
    unsupported = {"rollout.async_rollout": rollout.async_rollout,
                   "rollout.dynamic_sampling": rollout.dynamic_sampling,
                   "reward.model_path": config.reward.model_path,
                   "actor.offload": config.actor.offload, "critic.offload": config.critic.offload}
    errors += [f"{name} is not supported {why}" for name, value in unsupported.items() if value]
    if config.algorithm.estimator == "remax":
        errors.append(f"algorithm.estimator=remax is not supported {why} (its greedy baseline "
                      "needs the engine on the trainer ranks)")
    instances = placement.engine_ranks(world_size) // max(rollout.rollout_tp, 1)
    if instances and rollout.prompts_per_step % instances:
        errors.append(f"rollout.prompts_per_step={rollout.prompts_per_step} must be divisible "
                      f"by the {instances} vLLM instances of the rollout ranks "
                      f"(placement.rollout_ranks / rollout.rollout_tp)")
    return errors


def _old_logprob_errors(config: JobConfig) -> list[str]:
    """rollout.old_logprobs=update needs a batch the update's forward pass can score alone;
    =engine is exact only for a batch used for one on-policy step, sampled from the whole
    distribution; r2 replays the routes of a trainer pass."""
    rollout, trainer = config.rollout, config.trainer
    if rollout.routing_replay == "r2" and rollout.old_logprobs in ("update", "engine"):
        return [f"rollout.routing_replay=r2 replays the routes of the old-log-prob pass, which "
                f"rollout.old_logprobs={rollout.old_logprobs} skips"]
    if rollout.old_logprobs == "update":
        return [f"rollout.old_logprobs=update cannot be used: {blocker} (use auto or trainer)"
                for blocker in own_old_logprob_blockers(config)]
    if rollout.old_logprobs != "engine":
        return []
    errors = []
    if (trainer.ppo_epochs, trainer.mini_batches) != (1, 1):
        errors.append(f"rollout.old_logprobs=engine needs one optimizer step per batch "
                      f"(trainer.ppo_epochs={trainer.ppo_epochs} and trainer.mini_batches="
                      f"{trainer.mini_batches} must both be 1)")
    if rollout.async_rollout or rollout.max_staleness or rollout.importance_cap:
        errors.append("rollout.old_logprobs=engine needs on-policy batches without "
                      "importance sampling (rollout.async_rollout=false, max_staleness=0, "
                      "importance_cap=0)")
    errors += _truncated_logprob_errors(rollout, "rollout.old_logprobs=engine",
                                        "the trainer's ratio and the teacher's KL need",
                                        "rollout.old_logprobs=trainer")
    return errors


def _truncated_logprob_errors(rollout, use: str, need: str, instead: str) -> list[str]:
    """A `use` of the engine's log-probs that needs them under the whole tempered distribution
    is refused where the engine reports them renormalised over what top-k/top-p kept
    (`RolloutConfig.engine_logprobs_whole`)."""
    if rollout.engine_logprobs_whole:
        return []
    sampling = rollout.sampling
    return [f"{use} with rollout.sampling.top_p={sampling.top_p}, top_k={sampling.top_k} at "
            f"temperature={sampling.temperature}: vLLM reports log-probs renormalised over the "
            f"tokens top-k/top-p kept (whole-distribution ones only at temperature 1), and "
            f"{need} the whole softmax (the ratio would carry the kept mass, at sequence level "
            f"its product); use temperature 1.0, or top_p=1.0 and top_k=-1, or {instead}"]


def validate_sft(config: JobConfig, world_size: int) -> JobConfig:
    """`validate` plus the rules of a supervised job."""
    return validate_dataset_job(config, world_size, "sft", "SFT")


def validate_dataset_job(config: JobConfig, world_size: int, section: str,
                         what: str) -> JobConfig:
    """`validate` plus the rules of a job trained on the fixed dataset of config.<section>
    (sft, rm, dpo): its own fields and the chat-template mode its prompts are encoded with."""
    config = validate(config, world_size)
    dp_size = config.parallel.data_parallel_size(world_size)
    errors = getattr(config, section).errors(dp_size) + colocated_only_errors(config)
    errors += moe_job_errors(config, section)
    errors += lora_errors(config, getattr(config, section).lora, f"{section}.lora")
    if config.data.chat_template_mode() not in CHAT_TEMPLATE_MODES:
        errors.append(f"data.apply_chat_template={config.data.apply_chat_template!r} must be "
                      f"one of {', '.join(CHAT_TEMPLATE_MODES)}")
    if errors:
        raise ConfigError("invalid %s configuration (world size %d):\n  - %s"
                          % (what, world_size, "\n  - ".join(errors)))
    return config


def colocated_only_errors(config: JobConfig) -> list[str]:
    """Split placement is for RL jobs: every other job trains on every rank."""
    if not config.placement.split:
        return []
    return [f"placement.rollout_ranks={config.placement.rollout_ranks} is for RL jobs "
            "(mcore-rl train); this job trains on every rank"]


def _rl_batch_errors(config: JobConfig, world_size: int) -> list[str]:
    """Each data-parallel rank's share of a step must cut into whole mini- and micro-batches."""
    dp_size = config.parallel.data_parallel_size(config.placement.trainer_ranks(world_size))
    prompts = config.rollout.prompts_per_step
    if prompts % dp_size:
        return [f"rollout.prompts_per_step={prompts} must be divisible by the data-parallel "
                f"size {dp_size}"]
    rows = prompts // dp_size * config.rollout.sampling.n
    mini_batches = config.trainer.mini_batches
    if rows % mini_batches:
        return [f"each data-parallel rank's {rows} responses per step (prompts_per_step / DP x "
                f"sampling.n) must be divisible by trainer.mini_batches={mini_batches}"]
    errors = []
    for role in ("actor", "critic") if config.algorithm.needs_critic else ("actor",):
        micro = getattr(config, role).micro_batch_size
        budget = config.micro_batch_tokens(role)
        length = config.sequence_length()
        if micro < 1:
            errors.append(f"{role}.micro_batch_size={micro} must be >= 1")
        elif getattr(config, role).max_tokens_per_micro_batch < -1:
            errors.append(f"{role}.max_tokens_per_micro_batch must be -1 (derived), 0 (fixed "
                          f"rows) or a token budget")
        elif budget and budget < length:
            errors.append(f"{role}.max_tokens_per_micro_batch={budget} must hold the "
                          f"longest sequence, {_sequence_length_fields(config)} = {length}")
        elif not budget and (rows // mini_batches) % micro:
            errors.append(f"{role}.micro_batch_size={micro} must divide the {rows // mini_batches}"
                          " responses of a mini-batch on each data-parallel rank")
    return errors

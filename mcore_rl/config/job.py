"""The root configuration of one mcore_rl job and the validation of every job.

`validate` checks the rules every job shares; each job kind adds its own cross-section rules
on top: `validate_dataset_job` here (SFT, RM, DPO), `validate_rl` in rl_validation.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .algorithm import AlgorithmConfig
from .data import CHAT_TEMPLATE_MODES, DataConfig
from .model import InitConfig, ModelConfig
from .parallel import ParallelConfig
from .placement import PlacementConfig
from .preference import DpoConfig, RmConfig
from .reward import RewardConfig
from .lora import LoraConfig
from .rl import RolloutConfig
from .roles import ActorConfig, CriticConfig, ReferenceConfig
from .trainer import TrainerConfig
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

    def engine_instances(self, world_size: int) -> int:
        """Rollout engine instances (the rollout data-parallel size): the engine's ranks
        (placement.engine_ranks) in groups of rollout.rollout_tp. The config's one count of
        them; `resharding.RolloutLayout.instances` of the layout built from this config is the
        same."""
        return self.placement.engine_ranks(world_size) // max(self.rollout.rollout_tp, 1)

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
    jobs other than MOE_DATASET_JOBS (RL has its own rules: rl_validation.py's
    `_moe_rl_errors`)."""
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

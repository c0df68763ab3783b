"""The RL job's cross-section rules: `validate_rl`.

Why this module exists
----------------------
An RL job combines most sections of the config (roles, rollout, placement, teacher, MoE, batch
arithmetic), and its rules read several of them at once: whether the rollout engine can serve
a Mixture-of-Experts model at this placement, whether the old log-probs can come from the
update, whether a step's prompts cut into whole micro-batches. They live here, beside the
JobConfig they check (job.py), so that job.py keeps the dataclass and the rules every job
shares.
"""

from __future__ import annotations

from typing import Iterable

from .job import ConfigError, JobConfig, lora_errors, own_old_logprob_blockers, validate
from .rl import rollout_tp_errors


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
    if config.reward.shaping.active and config.algorithm.needs_greedy_baseline:
        errors.append(f"reward.shaping cannot be combined with algorithm.estimator="
                      f"{config.algorithm.estimator}: its greedy baseline is scored without the "
                      f"shaping")
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
                   "actor.offload": config.actor.offload, "critic.offload": config.critic.offload,
                   "trainer.val_only": config.trainer.val_only}
    errors += [f"{name} is not supported {why}" for name, value in unsupported.items() if value]
    if config.algorithm.needs_greedy_baseline:
        errors.append(f"algorithm.estimator={config.algorithm.estimator} is not supported {why} "
                      "(its greedy baseline needs the engine on the trainer ranks)")
    instances = config.engine_instances(world_size)
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

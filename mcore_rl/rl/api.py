"""The short Python entry point: `make_trainer_config(...)` with the knobs most runs change.

    config  = make_trainer_config(algo="ppo", actor_micro_batch_size=4, critic_micro_batch_size=4,
                                  rollouts_per_device=64, vf_coef=0.1, clip_eps=0.2,
                                  mixed_precision="bf16", overrides=["data.train_files=[x.parquet]"])
    trainer = Trainer(config, actor_model="/models/Qwen2.5-0.5B", reward_fn=my_score)
    for step in range(1000):
        data    = trainer.collect_data(prompts)    # or collect_data() for the dataset's next batch
        results = trainer.update_policy(data)
        print(step, results["reward"])

Every keyword maps onto one field of the job config (documented there); anything else goes in
`overrides` as dotted key=value strings, applied after `config_file`.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Iterable, Optional

from mcore_rl.config import InitConfig, JobConfig, ModelConfig, load_config
from mcore_rl.conversion.model_source import with_model_from_init
from mcore_rl.runtime.launch_env import read_launch_env
from mcore_rl.sandbox.user_code import check_sendable

ALGORITHMS = {"ppo": "gae"}
"""Short algorithm names that choose an advantage estimator (ppo: PPO with a critic and GAE);
any estimator name (grpo, rloo, reinforce_plus_plus, ...) is accepted as itself."""

PRECISIONS = {"no": "fp32", "fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}


def make_trainer_config(algo: str = "grpo", *, config_file: Optional[str] = None,
                        overrides: Iterable[str] = (),
                        actor_micro_batch_size: Optional[int] = None,
                        critic_micro_batch_size: Optional[int] = None,
                        rollouts_per_device: Optional[int] = None,
                        vf_coef: Optional[float] = None, clip_eps: Optional[float] = None,
                        mixed_precision: Optional[str] = None,
                        actor_model: Optional[str] = None) -> JobConfig:
    """A validated-on-start JobConfig. rollouts_per_device: responses per rank per step
    (rollout.prompts_per_step = rollouts_per_device x world size / sampling.n)."""
    settings = [f"algorithm.estimator={ALGORITHMS.get(algo, algo)}"]
    if actor_micro_batch_size is not None:
        settings.append(f"actor.micro_batch_size={actor_micro_batch_size}")
    if critic_micro_batch_size is not None:
        settings.append(f"critic.micro_batch_size={critic_micro_batch_size}")
    if vf_coef is not None:
        settings.append(f"algorithm.value_loss_coef={vf_coef}")
    if clip_eps is not None:
        settings += [f"algorithm.clip_ratio_low={clip_eps}", f"algorithm.clip_ratio_high={clip_eps}"]
    if mixed_precision is not None:
        if mixed_precision not in PRECISIONS:
            raise ValueError(f"mixed_precision={mixed_precision!r} must be one of "
                             f"{sorted(PRECISIONS)}")
        settings.append(f"runtime.precision={PRECISIONS[mixed_precision]}")
    config = load_config(config_file, settings + list(overrides))
    if rollouts_per_device is not None:
        responses = rollouts_per_device * read_launch_env().world_size
        samples = config.rollout.sampling.n
        if responses % samples:
            raise ValueError(f"rollouts_per_device={rollouts_per_device} x world size must be a "
                             f"multiple of rollout.sampling.n={samples}")
        config = dataclasses.replace(config, rollout=dataclasses.replace(
            config.rollout, prompts_per_step=responses // samples))
    if actor_model is not None:
        config = with_actor_model(config, actor_model)
    return config


def with_actor_model(config: JobConfig, path: str) -> JobConfig:
    """The config with its starting weights (and architecture) taken from `path`, an HF folder
    or an mcore_rl checkpoint."""
    return with_model_from_init(dataclasses.replace(config, init=InitConfig.from_path(path),
                                                    model=ModelConfig()))


def with_environment(config: JobConfig, environment: type) -> JobConfig:
    """The config with `environment` (an mcore_rl.agents.Environment subclass defined at the
    top level of a module or of the script: the episodes' sandboxed processes load it by its
    module and name, the script's by value) as the multi-turn environment."""
    check_sendable(environment, "environment")
    reference = f"{environment.__module__}:{environment.__qualname__}"
    multi_turn = dataclasses.replace(config.rollout.multi_turn, environment=reference)
    return dataclasses.replace(config, rollout=dataclasses.replace(config.rollout,
                                                                   multi_turn=multi_turn))


def with_agent(config: JobConfig, agent) -> JobConfig:
    """The config with `agent` (`async def run(row, base_url) -> reward`, a module-level
    function: each rank resolves it by module and name) as the multi-turn agent."""
    if not inspect.iscoroutinefunction(agent) or "<locals>" in agent.__qualname__ or \
            agent.__name__ == "<lambda>":
        raise ValueError(f"agent {getattr(agent, '__qualname__', agent)!r} must be a "
                         "module-level async function run(row, base_url) -> reward")
    multi_turn = dataclasses.replace(config.rollout.multi_turn,
                                     agent=f"{agent.__module__}:{agent.__qualname__}")
    return dataclasses.replace(config, rollout=dataclasses.replace(config.rollout,
                                                                   multi_turn=multi_turn))

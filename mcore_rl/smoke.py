"""`mcore-rl smoke`: a distributed forward/backward run on random tokens.

The main job until the RL trainer lands: it builds the configured model in the configured
TP x PP x DP layout (random weights, or `init.hf_path` / `init.checkpoint`), trains it for a few
steps with a next-token loss on random right-padded sequences, and prints loss and throughput on
rank 0. It exercises the same runtime, model,
schedule, DDP and optimizer code that RL training uses.
"""

from __future__ import annotations

import time

import torch

from .config import ConfigError, JobConfig, validate
from .config.job import colocated_only_errors, moe_job_errors
from .conversion.model_source import with_model_from_init
from .models.pretrained import build_from_init
from .runtime import initialize, print0, read_launch_env, shutdown
from .training import make_trainable, shard_for_data_parallel, train_step


def random_batch(config: JobConfig, step: int) -> dict:
    """Right-padded random sequences, identical on every rank for a given step."""
    generator = torch.Generator().manual_seed(config.runtime.seed + step)
    rows, length = config.batch.global_batch_size, config.batch.seq_length
    input_ids = torch.randint(0, config.model.vocab_size, (rows, length), generator=generator)
    lengths = torch.randint(length // 2, length + 1, (rows,), generator=generator)
    attention_mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).long()
    return {"input_ids": input_ids * attention_mask, "attention_mask": attention_mask}


def next_token_loss(outputs: dict, micro_batch: dict):
    """Token-mean negative log-likelihood over real tokens (position 0 has no prediction)."""
    mask = micro_batch["attention_mask"].clone()
    mask[:, 0] = 0
    return -(outputs["logprobs"] * mask).sum(), mask.sum(), {}


def run_smoke(config: JobConfig) -> list[dict]:
    """Train for config.smoke.steps steps; returns the per-step metrics."""
    launch = read_launch_env()
    config = validate(with_model_from_init(config), launch.world_size)
    errors = colocated_only_errors(config) + moe_job_errors(config, "smoke")
    if errors:
        raise ConfigError(errors[0])
    runtime = initialize(config, launch)
    here = runtime.training
    model = build_from_init(config.init, config.model, config.parallel,
                            config.runtime.precision, device=runtime.device, place=here)
    if config.init.hf_path or config.init.checkpoint:
        print0(f"smoke: weights from {config.init.hf_path or config.init.checkpoint}")
    trainable = make_trainable(model, config.optimizer, config.runtime.precision)
    dp_rank, dp_size = here.dp_rank, here.dp_size
    print0(f"smoke: world {runtime.world_size} = TP {config.parallel.tensor_model_parallel_size}"
           f" x PP {config.parallel.pipeline_model_parallel_size} x DP {dp_size}, "
           f"backend {runtime.backend}, precision {config.runtime.precision}")
    history = []
    for step in range(config.smoke.steps):
        batch = random_batch(config, step)
        tokens = int(batch["attention_mask"].sum())
        local = shard_for_data_parallel(batch, dp_rank, dp_size)
        start = time.perf_counter()
        metrics = train_step(trainable, local, config.batch.micro_batch_size, next_token_loss,
                             vocab_size=config.model.vocab_size)
        elapsed = time.perf_counter() - start
        metrics.update(step=step, seconds=elapsed, tokens_per_second=tokens / elapsed)
        history.append(metrics)
        print0(f"step {step}: loss {metrics['loss']:.4f}  grad_norm {metrics['grad_norm']:.3f}"
               f"  lr {metrics['lr']:.2e}  {metrics['tokens_per_second']:.0f} tokens/s")
    shutdown()
    return history

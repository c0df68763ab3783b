"""What one rank of a training-checkpoint world does (run by tests/test_training_checkpoint.py).

An actor (LM head, Megatron's distributed optimizer) and a critic (scalar head, the plain fp32
optimizer) train together on batches drawn from the global Python, NumPy and torch generators;
after every step each rank also draws from Megatron's model-parallel RNG tracker. So a resumed
run reproduces the uninterrupted one only if weights, optimizer states, LR schedules and every
rank's RNG states all come back. Each rank writes its per-step metrics, RNG draws and final
local parameters to `<out>/rank_<r>.pt`.
"""

from __future__ import annotations

import dataclasses

import os
import random
import signal

import numpy as np
import torch
import torch.distributed as dist

from mcore_rl.training import checkpointer as training_state
from mcore_rl.training.checkpointer import load_latest_training_state, save_training_state
from mcore_rl.config import (BatchConfig, JobConfig, ModelConfig, MoEConfig,
                             OptimizerConfig, ParallelConfig, RuntimeConfig)
from mcore_rl.models import build_gpt_model
from mcore_rl.runtime import initialize, shutdown
from mcore_rl.training import make_trainable, shard_for_data_parallel, train_step

MODEL = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                    num_kv_heads=2, vocab_size=128, max_position_embeddings=64)
MOE_MODEL = dataclasses.replace(MODEL, moe=MoEConfig(num_experts=4, ffn_hidden_size=32))
"""The model with experts split over the ranks when EP > 1."""
ACTOR_OPTIMIZER = OptimizerConfig(lr=1e-3, lr_warmup_steps=1, lr_decay_steps=4,
                                  lr_decay_style="cosine", min_lr=1e-4, weight_decay=0.01,
                                  use_distributed_optimizer=True)
CRITIC_OPTIMIZER = OptimizerConfig(lr=2e-3, lr_warmup_steps=2, clip_grad=0.5,
                                   use_distributed_optimizer=False)
STEPS = 3
KEEP_LAST = 2
CONFIG_YAML = "model:\n  num_layers: 2\n"


def job_config(tp: int, ep: int = 1, cp: int = 1) -> JobConfig:
    return JobConfig(model=MOE_MODEL if ep > 1 else MODEL,
                     parallel=ParallelConfig(tensor_model_parallel_size=tp,
                                             expert_model_parallel_size=ep,
                                             context_parallel_size=cp),
                     optimizer=ACTOR_OPTIMIZER,
                     batch=BatchConfig(global_batch_size=4, micro_batch_size=1, seq_length=16),
                     runtime=RuntimeConfig(seed=7))


def draw_batch(config: JobConfig) -> dict:
    """A global batch from the global generators (same draws on every rank)."""
    rows, length = config.batch.global_batch_size, config.batch.seq_length
    input_ids = torch.randint(0, MODEL.vocab_size, (rows, length))
    lengths = torch.from_numpy(np.random.randint(length // 2, length + 1, size=rows))
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).long()
    targets = torch.randn(rows, length) * random.uniform(0.5, 2.0)
    return {"input_ids": input_ids * mask, "attention_mask": mask, "value_targets": targets}


def next_token_loss(outputs: dict, micro_batch: dict):
    mask = micro_batch["attention_mask"].clone()
    mask[:, 0] = 0
    return -(outputs["logprobs"] * mask).sum(), int(mask.sum()), {}


def value_loss(outputs: dict, micro_batch: dict):
    mask = micro_batch["attention_mask"].clone()
    mask[:, 0] = 0
    error = (outputs["values"] - micro_batch["value_targets"]) ** 2
    return (error * mask).sum(), int(mask.sum()), {}


def build_models(config: JobConfig, place) -> dict:
    actor = build_gpt_model(config.model, config.parallel, "fp32", head="lm", place=place)
    critic = build_gpt_model(config.model, config.parallel, "fp32", head="scalar", place=place)
    return {"actor": make_trainable(actor, ACTOR_OPTIMIZER, "fp32"),
            "critic": make_trainable(critic, CRITIC_OPTIMIZER, "fp32")}


def rank_state(step: int) -> dict:
    """What each rank saves for itself (differs between ranks)."""
    return {"rank": dist.get_rank(), "step": step}


def trainer_state(step: int) -> dict:
    """Stands in for the trainer's state (sampler position, KL controller, ...)."""
    return {"sampler": {"epoch": 0, "position": 4 * step}, "kl_coef": 0.1 / step, "step": step}


def tracker_draw() -> torch.Tensor:
    from megatron.core import tensor_parallel

    with tensor_parallel.get_cuda_rng_tracker().fork():
        return torch.rand(4)


def _die_before_publishing(*args, **kwargs) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def run(tp: int, root: str, out: str, resume: bool, save_steps: tuple, kill_at: int,
        actor_from: int, ep: int = 1, cp: int = 1, rank_states: bool = True) -> None:
    """Train steps 1..STEPS (after the newest checkpoint when `resume`), saving after each step
    in `save_steps`; with `kill_at`, rank 0 SIGKILLs itself in that step's save, after every
    rank has written its files but before the checkpoint is published. The actor trains from
    step `actor_from` on (a critic warm-up: until then its optimizer has no state). ep > 1:
    the MoE model with its experts split over the ranks; cp > 1: context parallelism;
    rank_states False: the ranks save no state of their own (rank_state None)."""
    import logging

    from megatron.core import parallel_state

    # On the CPU the tracker's fork swaps the CPU generator itself, so Megatron's "CPU RNG state
    # changed within GPU RNG context" warning fires on every draw.
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
    config = job_config(tp, ep, cp)
    place = initialize(config).training
    models = build_models(config, place)
    record = {"metrics": {}, "draws": {}, "loaded": None}
    first = 1
    if resume:
        try:
            load_latest_training_state(root, {"actor": models["actor"]}, place=place)
        except ValueError as error:
            record["role_error"] = str(error)
        step, state = load_latest_training_state(root, models, place=place)
        record["loaded"] = (step, state)
        first = step + 1
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    for step in range(first, STEPS + 1):
        local = shard_for_data_parallel(draw_batch(config), dp_rank, dp_size)
        metrics = {"critic": train_step(models["critic"], local, 1, value_loss, head="scalar")}
        if step >= actor_from:
            metrics["actor"] = train_step(models["actor"], local, 1, next_token_loss, head="lm",
                                          vocab_size=MODEL.vocab_size)
        record["metrics"][step] = metrics
        record["draws"][step] = tracker_draw()
        if step in save_steps:
            if step == kill_at and dist.get_rank() == 0:
                training_state._publish = _die_before_publishing
            save_training_state(root, step, models, trainer_state(step), CONFIG_YAML, KEEP_LAST,
                                rank_state=rank_state(step) if rank_states else None,
                                place=place)
    record["params"] = {role: {name: param.detach().clone() for name, param in
                               model.chunks[0].module.named_parameters()}
                        for role, model in models.items()}
    torch.save(record, os.path.join(out, f"rank_{dist.get_rank()}.pt"))
    shutdown()

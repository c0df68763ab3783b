"""One rank of a token-budget world (run by tests/test_token_budget.py): the same model and
batch scored and trained with fixed micro-batches, with token-budget micro-batches, and with
an `output_mask` (the output layer only from the first "response" position on), alone and with
a token budget; the loss always SFT's, over the "response" positions (loss_mask)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_rl.config import (BatchConfig, JobConfig, ModelConfig, MoEConfig, OptimizerConfig,
                             ParallelConfig)
from mcore_rl.models import build_gpt_model
from mcore_rl.runtime import initialize, seed_everything, shutdown
from mcore_rl.sft.trainer import sft_loss
from mcore_rl.smoke import random_batch
from mcore_rl.training import compute_outputs, make_trainable, train_step
from mcore_rl.training.batches import token_budget_micro_batches

ROWS, LENGTH, VOCAB = 8, 24, 64


def with_responses(batch: dict) -> dict:
    """The batch with a loss_mask over each row's last tokens from a prompt length of 6..11
    on (every row is at least 12 long)."""
    generator = torch.Generator().manual_seed(1)
    prompt_lengths = torch.randint(6, 12, (ROWS,), generator=generator)
    positions = torch.arange(LENGTH).unsqueeze(0)
    return dict(batch, loss_mask=batch["attention_mask"] * (positions >= prompt_lengths[:, None]))


def compare_micro_batching(pipeline: int, max_tokens: int,
                           expert_parallel: int = 1) -> dict:
    """With expert_parallel > 1: a Mixture-of-Experts model with its experts split over the
    (data-parallel) ranks, each scoring its own rows; the second rank's rows cut to 12 tokens,
    so a token budget gives the ranks different numbers of micro-batches (fillers even them)."""
    moe = MoEConfig(num_experts=4, ffn_hidden_size=32, router_topk=2) \
        if expert_parallel > 1 else MoEConfig()
    config = JobConfig(model=ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128,
                                         num_attention_heads=4, num_kv_heads=2,
                                         vocab_size=VOCAB, max_position_embeddings=32, moe=moe),
                       parallel=ParallelConfig(pipeline_model_parallel_size=pipeline,
                                               expert_model_parallel_size=expert_parallel),
                       optimizer=OptimizerConfig(lr=1e-2),
                       batch=BatchConfig(global_batch_size=ROWS, micro_batch_size=2,
                                         seq_length=LENGTH))
    place = initialize(config).training
    batch = with_responses(random_batch(config, 0))
    if expert_parallel > 1:
        batch = _this_ranks_rows(batch, dist.get_rank(), expert_parallel)
    sliced = dict(batch, output_mask=batch["loss_mask"])
    results = {}
    for name, rows, budget in (("fixed", batch, 0), ("budget", batch, max_tokens),
                               ("output_mask", sliced, 0),
                               ("budget_output_mask", sliced, max_tokens)):
        seed_everything(config.runtime.seed)
        trainable = make_trainable(build_gpt_model(config.model, config.parallel, place=place),
                                   config.optimizer, "fp32")
        outputs = compute_outputs(trainable.chunks, rows, 2, "lm", VOCAB, max_tokens=budget)
        metrics = train_step(trainable, rows, 2, sft_loss, "lm", VOCAB, max_tokens=budget)
        after = compute_outputs(trainable.chunks, rows, 2, "lm", VOCAB, max_tokens=budget)
        results[name] = {"logprobs": outputs["logprobs"], "entropy": outputs["entropy"],
                         "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
                         "logprobs_after": after["logprobs"]}
    micro_batches = len(token_budget_micro_batches(batch, max_tokens)[0])
    shutdown()
    return {"results": results, "batch": batch, "budget_micro_batches": micro_batches}


def _this_ranks_rows(batch: dict, rank: int, ranks: int) -> dict:
    """Rank `rank`'s share of the rows; on every rank but the first, cut to 12 tokens."""
    share = ROWS // ranks
    rows = {name: tensor[rank * share:(rank + 1) * share] for name, tensor in batch.items()}
    if rank > 0:
        keep = (torch.arange(LENGTH) < 12).long()
        rows.update(attention_mask=rows["attention_mask"] * keep,
                    loss_mask=rows["loss_mask"] * keep, input_ids=rows["input_ids"] * keep)
    return rows

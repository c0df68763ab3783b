"""One rank of a token-budget world (run by tests/test_token_budget.py): the same model and
batch scored and trained with fixed micro-batches, with token-budget micro-batches, and with
an `output_mask` (the output layer only from the first "response" position on), alone and with
a token budget; the loss always SFT's, over the "response" positions (loss_mask)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_rl.config import BatchConfig, JobConfig, ModelConfig, OptimizerConfig, ParallelConfig
from mcore_rl.models import build_gpt_model
from mcore_rl.runtime import initialize, seed_everything, shutdown
from mcore_rl.sft.trainer import sft_loss
from mcore_rl.smoke import random_batch
from mcore_rl.training import compute_outputs, make_trainable, train_step

ROWS, LENGTH, VOCAB = 8, 24, 64


def with_responses(batch: dict) -> dict:
    """The batch with a loss_mask over each row's last tokens from a prompt length of 6..11
    on (every row is at least 12 long)."""
    generator = torch.Generator().manual_seed(1)
    prompt_lengths = torch.randint(6, 12, (ROWS,), generator=generator)
    positions = torch.arange(LENGTH).unsqueeze(0)
    return dict(batch, loss_mask=batch["attention_mask"] * (positions >= prompt_lengths[:, None]))


def compare_micro_batching(out_path: str, pipeline: int, max_tokens: int) -> None:
    config = JobConfig(model=ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128,
                                         num_attention_heads=4, num_kv_heads=2,
                                         vocab_size=VOCAB, max_position_embeddings=32),
                       parallel=ParallelConfig(pipeline_model_parallel_size=pipeline),
                       optimizer=OptimizerConfig(lr=1e-2),
                       batch=BatchConfig(global_batch_size=ROWS, micro_batch_size=2,
                                         seq_length=LENGTH))
    initialize(config)
    batch = with_responses(random_batch(config, 0))
    sliced = dict(batch, output_mask=batch["loss_mask"])
    results = {}
    for name, rows, budget in (("fixed", batch, 0), ("budget", batch, max_tokens),
                               ("output_mask", sliced, 0),
                               ("budget_output_mask", sliced, max_tokens)):
        seed_everything(config.runtime.seed)
        trainable = make_trainable(build_gpt_model(config.model, config.parallel),
                                   config.optimizer, "fp32")
        outputs = compute_outputs(trainable.chunks, rows, 2, "lm", VOCAB, max_tokens=budget)
        metrics = train_step(trainable, rows, 2, sft_loss, "lm", VOCAB, max_tokens=budget)
        after = compute_outputs(trainable.chunks, rows, 2, "lm", VOCAB, max_tokens=budget)
        results[name] = {"logprobs": outputs["logprobs"], "entropy": outputs["entropy"],
                         "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
                         "logprobs_after": after["logprobs"]}
    if dist.get_rank() == 0:
        torch.save({"results": results, "batch": batch}, out_path)
    shutdown()

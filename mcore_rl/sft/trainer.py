"""The supervised job: the RL actor's model trained on demonstrations, one SPMD program on
every rank.

    examples = load(sft.train_files)                     (every rank, the same order)
    for epoch, step: train_step(this DP rank's share of the step's examples)
    after every epoch: loss on sft.val_files
    save output_dir/model: a weights checkpoint with the tokenizer, for init.checkpoint
    (with sft.lora: the adapters merged, and output_dir/adapter: the adapters as a peft adapter)

It goes through the RL training path unchanged (Megatron DDP, distributed optimizer, pipeline
schedules, the global (numerator, denominator) loss of `train_step`), so the loss is the exact
token mean over the whole batch whatever the layout.
"""

from __future__ import annotations

import os

import torch

from mcore_rl.checkpoint.weights_io import save_weights
from mcore_rl.config import ConfigError, JobConfig
from mcore_rl.conversion.export import hf_metadata, tokenizer_files
from mcore_rl.conversion.peft_adapter import ADAPTER_DIR
from mcore_rl.data import pad_id
from mcore_rl.models.pretrained import build_from_init
from mcore_rl.models.lora import served_parameters
from mcore_rl.observability import METRICS_FILE
from mcore_rl.observability.step_metrics import MetricsLogger
from mcore_rl.runtime import print0
from mcore_rl.runtime.model_rank import ModelRank
from mcore_rl.training import compute_outputs, make_trainable, train_step
from mcore_rl.training.adapter_export import export_adapters
from mcore_rl.training.dataset_job import data_parallel_sums, run_epochs, start_dataset_job

from .data import EncodedDemonstrations, load_demonstrations, make_batch

MODEL_DIR = "model"


def sft_loss(outputs: dict, micro_batch: dict):
    """Summed negative log-likelihood of the loss-mask tokens, and their count."""
    mask = micro_batch["loss_mask"].float()
    return -(outputs["logprobs"] * mask).sum(), mask.sum(), {}


def run_sft(config: JobConfig) -> str:
    """Train on config.sft's demonstrations and return the written checkpoint's path."""
    job = start_dataset_job(config, "sft", "SFT", (MODEL_DIR, METRICS_FILE), "an SFT run")
    config, tokenizer = job.config, job.tokenizer
    train = _load(config, config.sft.train_files, tokenizer, "train")
    validation = _load(config, config.sft.val_files, tokenizer, "val")
    if len(train.token_ids) < config.sft.batch_size:
        raise ConfigError(f"sft.batch_size={config.sft.batch_size} exceeds the "
                          f"{len(train.token_ids)} training examples")
    precision = config.runtime.precision
    module = build_from_init(config.init, config.model, config.parallel, precision, "lm",
                             job.runtime.device, config.sft.lora, config.runtime.seed,
                             place=job.place)
    trainable = make_trainable(module, config.sft.optimizer, precision)
    steps = _train(config, job.place, trainable, train, validation, job.logger,
                   pad_id(tokenizer))
    model_dir = os.path.join(config.runtime.output_dir, MODEL_DIR)
    save_weights(model_dir, served_parameters(module), config.model, job.place,
                 extra_metadata=hf_metadata(config), tokenizer_files=tokenizer_files(tokenizer))
    export_adapters(module, config, os.path.join(config.runtime.output_dir, ADAPTER_DIR))
    print0(f"sft: {steps} steps, weights and tokenizer in {model_dir}")
    job.close()
    return model_dir


def _train(config: JobConfig, here: ModelRank, trainable, train: EncodedDemonstrations,
           validation: EncodedDemonstrations, logger: MetricsLogger, pad_id: int) -> int:
    """The epochs of optimizer steps, logging each and the held-out loss when due; returns the
    number of steps."""
    sft, vocab_size = config.sft, config.model.vocab_size

    def train_on(rows: list[int], step_rows: list[int]) -> tuple[dict, int]:
        metrics = train_step(trainable, make_batch(train, rows, pad_id), sft.micro_batch_size,
                             sft_loss, "lm", vocab_size)
        return ({"sft/loss": metrics["loss"], "sft/grad_norm": metrics["grad_norm"],
                 "sft/lr": metrics["lr"]}, sum(len(train.token_ids[row]) for row in step_rows))

    def evaluate() -> dict:
        return {"sft/val_loss": validation_loss(here, trainable.chunks, validation,
                                                sft.micro_batch_size, vocab_size, pad_id)}

    return run_epochs(here, sft, len(train.token_ids), logger, "sft", train_on,
                      evaluate if validation.token_ids else None)


def _load(config: JobConfig, paths: list[str], tokenizer, split: str) -> EncodedDemonstrations:
    examples = load_demonstrations(paths, config.sft, tokenizer, config.data.chat_template_mode())
    if paths:
        print0(f"sft data ({split}): {len(examples.token_ids)} examples, "
               f"{examples.dropped_too_long} longer than sft.max_length={config.sft.max_length} "
               f"dropped")
    return examples


@torch.no_grad()
def validation_loss(here: ModelRank, chunks: list, examples: EncodedDemonstrations,
                    micro_batch_size: int, vocab_size: int, pad_id: int) -> float:
    """Token-mean negative log-likelihood of the responses, over all data-parallel ranks."""
    def sums_of(rows: list[int]) -> torch.Tensor:
        batch = make_batch(examples, rows, pad_id)
        logprobs = compute_outputs(chunks, batch, len(rows), "lm", vocab_size)["logprobs"]
        mask = batch["loss_mask"].double()
        return torch.stack([-(logprobs.double() * mask).sum(), mask.sum()])

    totals = data_parallel_sums(here, len(examples.token_ids), micro_batch_size, 2, sums_of)
    return (totals[0] / totals[1].clamp(min=1)).item()

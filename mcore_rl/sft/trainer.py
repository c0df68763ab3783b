"""The supervised job: the RL actor's model trained on demonstrations, one SPMD program on
every rank.

    examples = load(sft.train_files)                     (every rank, the same order)
    for epoch, step: train_step(this DP rank's share of the step's examples)
    after every epoch: loss on sft.val_files
    save output_dir/model: a weights checkpoint with the tokenizer, for init.checkpoint

It goes through the RL training path unchanged (Megatron DDP, distributed optimizer, pipeline
schedules, the global (numerator, denominator) loss of `train_step`), so the loss is the exact
token mean over the whole batch whatever the layout.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from mcore_rl.checkpoint.weights_io import megatron_coordinates, save_weights
from mcore_rl.config import ConfigError, JobConfig, to_yaml, validate_sft
from mcore_rl.conversion.export import hf_metadata, tokenizer_files
from mcore_rl.conversion.model_source import with_model_from_init
from mcore_rl.data import load_tokenizer, pad_id
from mcore_rl.models.pretrained import build_from_init
from mcore_rl.models.weights import local_parameters
from mcore_rl.observability import METRICS_FILE, refuse_earlier_run
from mcore_rl.observability.step_metrics import MetricsLogger
from mcore_rl.runtime import initialize, print0, read_launch_env, shutdown
from mcore_rl.runtime.devices import collective_device
from mcore_rl.runtime.progress import progress
from mcore_rl.training import compute_outputs, make_trainable, train_step

from .data import EncodedDemonstrations, epoch_order, load_demonstrations, make_batch, rank_rows

MODEL_DIR = "model"


def sft_loss(outputs: dict, micro_batch: dict):
    """Summed negative log-likelihood of the loss-mask tokens, and their count."""
    mask = micro_batch["loss_mask"].float()
    return -(outputs["logprobs"] * mask).sum(), mask.sum(), {}


def run_sft(config: JobConfig) -> str:
    """Train on config.sft's demonstrations and return the written checkpoint's path."""
    launch = read_launch_env()
    config = validate_sft(with_model_from_init(config), launch.world_size)
    runtime = initialize(config, launch)
    output_dir = config.runtime.output_dir
    # An SFT job does not resume: any earlier run in output_dir is refused.
    refuse_earlier_run(output_dir, (MODEL_DIR, METRICS_FILE), "already holds an SFT run")
    tokenizer = load_tokenizer(config)
    train = _load(config, config.sft.train_files, tokenizer, "train")
    validation = _load(config, config.sft.val_files, tokenizer, "val")
    if len(train.token_ids) < config.sft.batch_size:
        raise ConfigError(f"sft.batch_size={config.sft.batch_size} exceeds the "
                          f"{len(train.token_ids)} training examples")
    precision = config.runtime.precision
    module = build_from_init(config.init, config.model, config.parallel, precision, "lm",
                             runtime.device)
    trainable = make_trainable(module, config.sft.optimizer, precision)
    logger = MetricsLogger.for_job(config)
    if dist.get_rank() == 0:
        os.makedirs(output_dir, exist_ok=True)
        with open(os.path.join(output_dir, "config.yaml"), "w") as handle:
            handle.write(to_yaml(config))
    steps = _train(config, trainable, train, validation, logger, pad_id(tokenizer))
    model_dir = os.path.join(output_dir, MODEL_DIR)
    save_weights(model_dir, local_parameters(module), config.model, megatron_coordinates(),
                 extra_metadata=hf_metadata(config), tokenizer_files=tokenizer_files(tokenizer))
    logger.close()
    print0(f"sft: {steps} steps, weights and tokenizer in {model_dir}")
    shutdown()
    return model_dir


def _train(config: JobConfig, trainable, train: EncodedDemonstrations,
           validation: EncodedDemonstrations, logger: MetricsLogger, pad_id: int) -> int:
    """The epochs of optimizer steps, logging each and the held-out loss when due; returns the
    number of steps."""
    from megatron.core import parallel_state

    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    sft, vocab_size = config.sft, config.model.vocab_size
    steps_per_epoch = len(train.token_ids) // sft.batch_size
    step = 0
    with progress(total=sft.epochs * steps_per_epoch, desc="sft", unit="step") as bar:
        for epoch in range(sft.epochs):
            order = epoch_order(len(train.token_ids), sft.seed, epoch)
            for index in range(steps_per_epoch):
                started = time.perf_counter()
                rows = rank_rows(order, index, sft.batch_size, dp_rank, dp_size)
                metrics = train_step(trainable, make_batch(train, rows, pad_id),
                                     sft.micro_batch_size, sft_loss, "lm", vocab_size)
                step += 1
                bar.update(1)
                seconds = time.perf_counter() - started
                tokens = sum(len(train.token_ids[row])
                             for row in order[index * sft.batch_size:(index + 1) * sft.batch_size])
                logger.log(step, {"sft/loss": metrics["loss"],
                                  "sft/grad_norm": metrics["grad_norm"], "sft/lr": metrics["lr"],
                                  "sft/epoch": epoch + 1, "time/step": seconds,
                                  "throughput/tokens_per_second": tokens / seconds})
                epoch_done = index == steps_per_epoch - 1
                due = step % sft.eval_every == 0 if sft.eval_every else epoch_done
                if validation.token_ids and (due or (epoch_done and epoch == sft.epochs - 1)):
                    loss = validation_loss(trainable.chunks, validation, sft.micro_batch_size,
                                           vocab_size, pad_id)
                    logger.log(step, {"sft/val_loss": loss}, prefix="eval")
    return step


def _load(config: JobConfig, paths: list[str], tokenizer, split: str) -> EncodedDemonstrations:
    examples = load_demonstrations(paths, config.sft, tokenizer, config.data.chat_template_mode())
    if paths:
        print0(f"sft data ({split}): {len(examples.token_ids)} examples, "
               f"{examples.dropped_too_long} longer than sft.max_length={config.sft.max_length} "
               f"dropped")
    return examples


@torch.no_grad()
def validation_loss(chunks: list, examples: EncodedDemonstrations, micro_batch_size: int,
                    vocab_size: int, pad_id: int) -> float:
    """Token-mean negative log-likelihood of the responses, over all data-parallel ranks."""
    from megatron.core import parallel_state

    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    rows = list(range(dp_rank, len(examples.token_ids), dp_size))
    group = parallel_state.get_data_parallel_group()
    totals = torch.zeros(2, dtype=torch.float64, device=collective_device(group))
    for start in range(0, len(rows), micro_batch_size):
        chunk = rows[start:start + micro_batch_size]
        batch = make_batch(examples, chunk, pad_id)
        logprobs = compute_outputs(chunks, batch, len(chunk), "lm", vocab_size)["logprobs"]
        mask = batch["loss_mask"].double()
        totals += torch.stack([-(logprobs.double() * mask).sum(), mask.sum()]).to(totals.device)
    dist.all_reduce(totals, group=group)
    return (totals[0] / totals[1].clamp(min=1)).item()

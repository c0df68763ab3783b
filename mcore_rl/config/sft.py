"""Supervised fine-tuning (`mcore-rl sft`): demonstrations before RL.

RL from a model that never produces the answer format learns nothing (every reward is 0), so
most recipes start with a short supervised warm-up on demonstrations. The SFT job trains the
same Megatron model the RL actor is, on prompt/response rows in verl's SFT layout, and writes a
weights checkpoint that `init.checkpoint` (or `mcore-rl convert mcore-to-hf`) takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .data import FILE_EXTENSIONS
from .lora import LoraConfig
from .training import OptimizerConfig


@dataclass(frozen=True)
class SftConfig:
    """Demonstrations, batch sizes and optimizer of the supervised job."""

    train_files: list[str] = field(default_factory=list)
    """Demonstration files: .parquet, or .jsonl/.json; one row per example with a prompt (text
    or chat messages) and a response (text)."""

    val_files: list[str] = field(default_factory=list)
    """Held-out demonstrations, same format; their loss is logged as sft/val_loss (see
    eval_every)."""

    prompt_key: str = "prompt"
    """Column holding the prompt (encoded as in RL, with data.apply_chat_template)."""

    response_key: str = "response"
    """Column holding the response; the loss is on its tokens and the end-of-sequence token."""

    max_length: int = 1024
    """Examples with more prompt + response tokens than this are dropped at load time and
    counted."""

    epochs: int = 1
    """Passes over the training examples (each in a new seeded order)."""

    batch_size: int = 32
    """Examples per optimizer step, summed over data-parallel ranks (an epoch's last partial
    batch is left out)."""

    micro_batch_size: int = 4
    """Examples per forward/backward pass on one rank."""

    seed: int = 1
    """Seed of the example order."""

    eval_every: int = 0
    """Loss on sft.val_files every this many optimizer steps and after the last; 0: after
    every epoch."""

    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-5))
    """Adam and the LR schedule of the supervised steps."""

    lora: LoraConfig = field(default_factory=LoraConfig)
    """Train low-rank adapters on the frozen starting weights (docs/lora.md)."""

    def errors(self, data_parallel_size: int) -> list[str]:
        """Broken rules, each naming its field (empty when valid)."""
        return offline_job_errors(self, "sft", ("prompt_key", "response_key"),
                                  data_parallel_size)


def offline_job_errors(section_config, section: str, key_fields: tuple[str, ...],
                       data_parallel_size: int) -> list[str]:
    """The rules every job on a fixed dataset (sft, rm, dpo) shares: files, column names,
    counts, and a batch that splits into DP ranks x whole micro-batches."""
    config, errors = section_config, []
    if not config.train_files:
        errors.append(f"{section}.train_files is empty: the job needs training data")
    for name in ("train_files", "val_files"):
        for path in getattr(config, name):
            if not str(path).lower().endswith(FILE_EXTENSIONS):
                errors.append(f"{section}.{name}: {path!r} must end with one of "
                              f"{', '.join(FILE_EXTENSIONS)}")
    for name in key_fields:
        if not getattr(config, name):
            errors.append(f"{section}.{name} must not be empty")
    for name in ("max_length", "epochs", "batch_size", "micro_batch_size"):
        if getattr(config, name) < 1:
            errors.append(f"{section}.{name}={getattr(config, name)} must be >= 1")
    if config.eval_every < 0:
        errors.append(f"{section}.eval_every={config.eval_every} must be >= 0")
    rows_per_rank, remainder = divmod(config.batch_size, data_parallel_size)
    if remainder or rows_per_rank % max(config.micro_batch_size, 1):
        errors.append(f"{section}.batch_size={config.batch_size} must split into "
                      f"{data_parallel_size} data-parallel ranks x whole micro-batches of "
                      f"{section}.micro_batch_size={config.micro_batch_size}")
    return errors + config.optimizer.check(f"{section}.optimizer")

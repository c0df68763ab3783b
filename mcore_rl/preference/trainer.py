"""The preference jobs, one SPMD program on every rank: `mcore-rl rm` trains a Bradley-Terry
reward model (the actor's architecture with a scalar head), `mcore-rl dpo` the policy itself
against a frozen reference.

    pairs = load(<section>.train_files)                   (every rank, the same order)
    for epoch, step: train_step(this DP rank's share of the step's pairs)
    when due: loss, accuracy and margin on <section>.val_files
    save output_dir/model (weights checkpoint + tokenizer) and output_dir/hf (an HF folder:
    ...ForSequenceClassification with num_labels=1 for rm, ...ForCausalLM for dpo)

Both go through the RL training path unchanged (Megatron DDP, distributed optimizer, pipeline
schedules, `train_step`'s global (numerator, denominator) loss with the pair count as the
denominator), so the loss is the exact mean over the step's pairs whatever the layout.
"""

from __future__ import annotations

import os
from functools import partial

import torch

from mcore_rl.checkpoint.weights_io import save_weights
from mcore_rl.config import ConfigError, JobConfig
from mcore_rl.conversion.export import hf_metadata, tokenizer_files
from mcore_rl.conversion.mcore_to_hf import convert_mcore_to_hf
from mcore_rl.conversion.peft_adapter import ADAPTER_DIR
from mcore_rl.data import pad_id
from mcore_rl.models.lora import served_parameters
from mcore_rl.models.pretrained import build_from_init, copy_of_stage
from mcore_rl.observability import METRICS_FILE
from mcore_rl.roles import Reference
from mcore_rl.runtime import print0
from mcore_rl.training import compute_outputs, make_trainable, train_step
from mcore_rl.training.adapter_export import export_adapters
from mcore_rl.training.batches import with_score_slot
from mcore_rl.training.dataset_job import (DatasetJob, data_parallel_sums, run_epochs,
                                           start_dataset_job)

from .data import EncodedPairs, load_pairs, make_pair_batch
from .objectives import (DPO_STATISTICS, RM_STATISTICS, dpo_terms, pair_objective, pair_sums,
                         reward_model_terms)

MODEL_DIR = "model"
"""The weights checkpoint under runtime.output_dir (init.checkpoint takes it)."""
HF_DIR = "hf"
"""The HF folder under runtime.output_dir (reward.model_path takes the reward model's)."""


class PreferenceTrainer:
    """One preference job on config.<SECTION>; subclasses say which head, loss and inputs."""

    SECTION = ""
    WHAT = ""
    HEAD = "lm"
    STATISTICS: tuple[str, ...] = ()

    def __init__(self, config: JobConfig):
        self.config = config

    def fit(self) -> str:
        """Train, save, and return the HF folder's path (collective)."""
        job = start_dataset_job(self.config, self.SECTION, self.WHAT,
                                (MODEL_DIR, HF_DIR, METRICS_FILE), f"a {self.WHAT} run")
        self.config = config = job.config
        section = getattr(config, self.SECTION)
        train = self._load(job, section.train_files, "train")
        validation = self._load(job, section.val_files, "val")
        if train.num_pairs < section.batch_size:
            raise ConfigError(f"{self.SECTION}.batch_size={section.batch_size} exceeds the "
                              f"{train.num_pairs} training pairs")
        module = build_from_init(config.init, config.model, config.parallel,
                                 config.runtime.precision, self.HEAD, job.runtime.device,
                                 section.lora, config.runtime.seed, place=job.place)
        self.trainable = make_trainable(module, section.optimizer, config.runtime.precision)
        self.prepare(job, module)
        self.pad_id = pad_id(job.tokenizer)
        self.place = job.place
        steps = run_epochs(job.place, section, train.num_pairs, job.logger, self.SECTION,
                           partial(self._train_on, train),
                           partial(self._evaluate, validation) if validation.num_pairs else None)
        hf_dir = self._save(job, module)
        print0(f"{self.SECTION}: {steps} steps; weights in {config.runtime.output_dir}/"
               f"{MODEL_DIR}, HF folder {hf_dir}")
        job.close()
        return hf_dir

    # -- what a job adds -------------------------------------------------------------------
    def prepare(self, job: DatasetJob, module) -> None:
        """Build what the inputs need besides the trained model stage `module` (nothing by
        default)."""

    def inputs(self, batch: dict) -> dict:
        """The model inputs of a batch of pairs (the batch itself by default)."""
        return batch

    def terms(self, outputs: dict, micro_batch: dict):
        """Per-pair losses and statistics (objectives.PairTerms)."""
        raise NotImplementedError

    # -- shared ----------------------------------------------------------------------------
    def _load(self, job: DatasetJob, paths: list[str], split: str) -> EncodedPairs:
        section = getattr(job.config, self.SECTION)
        pairs = load_pairs(paths, section, job.tokenizer, job.config.data.chat_template_mode())
        if paths:
            print0(f"{self.SECTION} data ({split}): {pairs.num_pairs} pairs; "
                   f"{pairs.dropped_too_long} over {self.SECTION}.max_length="
                   f"{section.max_length} dropped, {pairs.truncated} truncated, "
                   f"{pairs.identical} with chosen == rejected skipped")
        return pairs

    def _train_on(self, train: EncodedPairs, pairs: list[int],
                  step_pairs: list[int]) -> tuple[dict, int]:
        section = getattr(self.config, self.SECTION)
        batch = self.inputs(make_pair_batch(train, pairs, self.pad_id))
        metrics = train_step(self.trainable, batch, 2 * section.micro_batch_size,
                             pair_objective(self.terms, self.SECTION), self.HEAD,
                             self.config.model.vocab_size)
        logged = {name: value for name, value in metrics.items()
                  if name.startswith(f"{self.SECTION}/")}
        logged.update({f"{self.SECTION}/loss": metrics["loss"],
                       f"{self.SECTION}/grad_norm": metrics["grad_norm"],
                       f"{self.SECTION}/lr": metrics["lr"]})
        tokens = sum(len(train.token_ids[row]) for pair in step_pairs
                     for row in (2 * pair, 2 * pair + 1))
        return logged, tokens

    @torch.no_grad()
    def _evaluate(self, validation: EncodedPairs) -> dict:
        """Loss and statistics over every held-out pair (collective)."""
        def sums_of(pairs: list[int]) -> torch.Tensor:
            batch = self.inputs(make_pair_batch(validation, pairs, self.pad_id))
            outputs = compute_outputs(self.trainable.chunks, batch, 2 * len(pairs), self.HEAD,
                                      self.config.model.vocab_size)
            return pair_sums(self.terms, outputs, batch, self.STATISTICS)

        section = getattr(self.config, self.SECTION)
        totals = data_parallel_sums(self.place, validation.num_pairs, section.micro_batch_size,
                                    2 + len(self.STATISTICS), sums_of)
        count = totals[1].clamp(min=1)
        means = {f"{self.SECTION}/val_loss": (totals[0] / count).item()}
        means.update({f"{self.SECTION}/val_{name}": (totals[2 + index] / count).item()
                      for index, name in enumerate(self.STATISTICS)})
        return means

    def _save(self, job: DatasetJob, module) -> str:
        """The weights checkpoint, then the HF folder converted from it (collective)."""
        config = job.config
        model_dir = os.path.join(config.runtime.output_dir, MODEL_DIR)
        save_weights(model_dir, served_parameters(module), config.model, job.place,
                     head=self.HEAD, extra_metadata=hf_metadata(config),
                     tokenizer_files=tokenizer_files(job.tokenizer))
        hf_dir = os.path.join(config.runtime.output_dir, HF_DIR)
        convert_mcore_to_hf(model_dir, hf_dir)
        if self.HEAD == "lm":  # peft's adapter of a causal LM; a scalar head's is not exported
            export_adapters(module, config, os.path.join(hf_dir, ADAPTER_DIR))
        return hf_dir


class RewardModelTrainer(PreferenceTrainer):
    """`mcore-rl rm`: a Bradley-Terry reward model, scored at each sequence's last token."""

    SECTION, WHAT, HEAD, STATISTICS = "rm", "reward-model", "scalar", RM_STATISTICS

    def inputs(self, batch: dict) -> dict:
        extended, last = with_score_slot(batch)
        return dict(extended, score_position=last)

    def terms(self, outputs: dict, micro_batch: dict):
        return reward_model_terms(outputs, micro_batch, self.config.rm)


class DpoTrainer(PreferenceTrainer):
    """`mcore-rl dpo`: the policy against a frozen reference with the same starting weights."""

    SECTION, WHAT, HEAD, STATISTICS = "dpo", "DPO", "lm", DPO_STATISTICS

    def prepare(self, job: DatasetJob, module) -> None:
        """The reference: a second stage holding a copy of the policy's starting weights (a
        copy, not a second load, so a randomly initialised policy gets the same reference); with
        dpo.lora, the policy itself with its adapters off."""
        config = job.config
        reference = module if config.dpo.lora.enabled else copy_of_stage(
            module, config.model, config.parallel, config.runtime.precision, job.runtime.device)
        self.reference = Reference(reference, config.model.vocab_size,
                                   2 * config.dpo.micro_batch_size, 1.0, offload=False)

    def inputs(self, batch: dict) -> dict:
        rows = batch["input_ids"].shape[0]
        return dict(batch, ref_logprobs=self.reference.logprobs(
            batch, min(rows, self.reference.micro_batch_size)))

    def terms(self, outputs: dict, micro_batch: dict):
        return dpo_terms(outputs, micro_batch, self.config.dpo)

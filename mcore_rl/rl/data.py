"""The RL trainer's side of the data: tokenized prompt records and this rank's share of each step.

Everything that can be wrong with the data (a bad row, an unloadable tokenizer) is found here, at
start-up, before any model is built (a data source without a reward function: rl.build).
"""

from __future__ import annotations

from dataclasses import dataclass

from mcore_rl.config import JobConfig
from mcore_rl.data import (DataError, PromptRecord, PromptSampler, encode_prompts, load_records,
                           load_tokenizer, pad_id)
from mcore_rl.runtime import print0


@dataclass
class TrainingData:
    """Prompts, their token ids and the sampler that deals them out per step."""

    records: list[PromptRecord]
    """Training records that survived filtering, in dataset order."""

    token_ids: list[list[int]]
    """Each kept record's prompt tokens."""

    validation: list[PromptRecord]
    """Validation records (possibly empty)."""

    validation_token_ids: list[list[int]]
    """Each validation record's prompt tokens."""

    sampler: PromptSampler
    """This data-parallel rank's view of the global, checkpointed order."""

    tokenizer: object
    """The HF tokenizer that encoded the prompts and decodes responses."""

    dp_rank: int
    dp_size: int
    max_prompt_tokens: int

    @property
    def pad_id(self) -> int:
        return pad_id(self.tokenizer)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The tokenizer's EOS always ends a response."""
        return (self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ()

    def next_batch(self) -> tuple[list[PromptRecord], list[list[int]]]:
        """This rank's records and prompt tokens for the next step."""
        indices = self.sampler.next_indices()
        return [self.records[i] for i in indices], [self.token_ids[i] for i in indices]

    def validation_shard(self) -> tuple[list[PromptRecord], list[list[int]]]:
        """Every dp_size-th validation record, starting at this rank's."""
        picked = range(self.dp_rank, len(self.validation), self.dp_size)
        return ([self.validation[i] for i in picked],
                [self.validation_token_ids[i] for i in picked])

    def encode_global(self, prompts: list) -> tuple[list[PromptRecord], list[list[int]]]:
        """This rank's contiguous share of a global prompt list (see `as_record` for what an
        item may be)."""
        if len(prompts) % self.dp_size:
            raise ValueError(f"{len(prompts)} prompts cannot be shared by {self.dp_size} "
                             "data-parallel ranks")
        share = len(prompts) // self.dp_size
        first = self.dp_rank * share
        records = [as_record(item, first + i)
                   for i, item in enumerate(prompts[first:first + share])]
        encoded = encode_prompts(records, self.tokenizer, self.max_prompt_tokens, "auto")
        if encoded.dropped_too_long:
            raise ValueError(f"{encoded.dropped_too_long} of the given prompts are longer than "
                             f"data.max_prompt_tokens={self.max_prompt_tokens}")
        return encoded.records, encoded.token_ids


RECORD_KEYS = ("prompt", "ground_truth", "data_source", "extra_info")


def as_record(item, index: int) -> PromptRecord:
    """A prompt handed to `Trainer.collect_data` as a record: a PromptRecord as it is; a text or
    a list of chat messages (data_source "custom", no ground truth); or a dict shaped like a
    verl data row, {"prompt": ..., "ground_truth": ..., "data_source": ..., "extra_info": ...}
    (all but "prompt" optional)."""
    if isinstance(item, PromptRecord):
        return item
    if not isinstance(item, dict):
        return PromptRecord(index=index, prompt=item, data_source="custom", ground_truth=None,
                            extra_info={})
    if "prompt" not in item or set(item) - set(RECORD_KEYS):
        raise ValueError(f"prompt {index}: a dict needs 'prompt' and may have "
                         f"{', '.join(RECORD_KEYS[1:])}; it has {sorted(item)}")
    return PromptRecord(index=index, prompt=item["prompt"],
                        data_source=item.get("data_source", "custom"),
                        ground_truth=item.get("ground_truth"),
                        extra_info=dict(item.get("extra_info") or {}))


def _encoded(config: JobConfig, split: str, tokenizer):
    records, skipped = load_records(config.data, split)
    encoded = encode_prompts(records, tokenizer, config.data.max_prompt_tokens,
                             config.data.apply_chat_template)
    print0(f"data ({split}): {len(encoded.records)} prompts, {skipped} bad rows skipped, "
           f"{encoded.dropped_too_long} longer than data.max_prompt_tokens="
           f"{config.data.max_prompt_tokens} dropped")
    return encoded


def load_training_data(config: JobConfig, dp_rank: int, dp_size: int) -> TrainingData:
    """Load and encode the splits and start the sampler."""
    tokenizer = load_tokenizer(config)
    train = _encoded(config, "train", tokenizer)
    validation = _encoded(config, "val", tokenizer)
    if config.trainer.evaluates:  # a job that never evaluates needs no prompt per rank
        check_validation_shards(len(validation.records), dp_size)
    if config.trainer.val_only and not validation.records:
        raise DataError("trainer.val_only=true evaluates the validation split, which is empty "
                        "(data.val_files, data.toy.val_size or data.reasoning_gym.val_size)")
    sampler = PromptSampler(len(train.records), config.rollout.prompts_per_step, dp_rank,
                            dp_size, config.data.seed, config.data.shuffle)
    return TrainingData(train.records, train.token_ids, validation.records, validation.token_ids,
                        sampler, tokenizer, dp_rank, dp_size, config.data.max_prompt_tokens)


def check_validation_shards(prompts: int, dp_size: int) -> None:
    """DataError unless every data-parallel rank gets a validation prompt (or there are none):
    a rank without one cannot evaluate while its peers wait for it. Checked at load when the
    job evaluates (trainer.eval_every or val_only), and again by every evaluation
    (`Trainer.evaluate` called by hand); every rank sees the same count, so all raise
    together."""
    if 0 < prompts < dp_size:
        raise DataError(
            f"the validation split (data.val_files, data.toy.val_size or data.reasoning_gym."
            f"val_size) has {prompts} prompts for {dp_size} data-parallel ranks: each rank "
            f"evaluates at least one; give at least {dp_size}, or none")

"""Prompt datasets for RL: verl-style parquet/JSON-lines files and built-in generators
(reasoning-gym, a toy copy task), encoded with the tokenizer's chat template and visited by a
DP-sharded, resumable sampler. Everything that can be wrong with the data fails at load time.

    records, skipped = load_records(config.data, "train")
    encoded = encode_prompts(records, tokenizer, config.data.max_prompt_tokens,
                             config.data.apply_chat_template)
    sampler = PromptSampler(len(encoded.records), prompts_per_step, dp_rank, dp_size,
                            config.data.seed, config.data.shuffle)
    for index in sampler.next_indices(): encoded.token_ids[index], encoded.records[index]
"""

from .encode import EncodedPrompts, encode_prompt, encode_prompts
from .load import load_records
from .reasoning_gym_source import ENTRY_KEY as REASONING_GYM_ENTRY_KEY
from .prompt_order import PromptSampler
from .records import DataError, PromptRecord
from .tokenizer import load_tokenizer, pad_id
from .toy import TOY_DATA_SOURCE, TOY_VOCAB, TOY_VOCAB_SIZE, toy_copy_records, write_toy_tokenizer

__all__ = ["DataError", "EncodedPrompts", "PromptRecord", "PromptSampler",
           "REASONING_GYM_ENTRY_KEY", "TOY_DATA_SOURCE", "TOY_VOCAB", "TOY_VOCAB_SIZE",
           "encode_prompt", "encode_prompts", "load_records", "load_tokenizer", "pad_id",
           "toy_copy_records",
           "write_toy_tokenizer"]

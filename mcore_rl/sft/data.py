"""Demonstrations for supervised fine-tuning: rows read, checked, tokenized and batched.

Prompts are encoded exactly as the RL trainer encodes them (the same chat-template rule), so the
warm-up teaches the model to answer the prompts RL will show it. The loss covers the response
and the end-of-sequence token after it: the model learns to stop, which is what ends a rollout.
Every row problem stops the load with the file and line, before the first step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from mcore_rl.config.sft import SftConfig
from mcore_rl.data.encode import encode_prompt
from mcore_rl.data.example_order import epoch_order, rank_rows  # noqa: F401 (re-exported)
from mcore_rl.data.files import iter_rows
from mcore_rl.data.records import BadRow, DataError, Prompt, check_prompt
from mcore_rl.data.sequences import padded_batch


@dataclass(frozen=True)
class Demonstration:
    """One prompt and the response the model should give."""

    prompt: Prompt
    response: str


@dataclass(frozen=True)
class EncodedDemonstrations:
    """Token ids of prompt + response + end-of-sequence, and where each response starts."""

    token_ids: list[list[int]]
    prompt_lengths: list[int]
    dropped_too_long: int
    """Examples longer than sft.max_length, left out."""


def read_demonstrations(path: str, prompt_key: str, response_key: str) -> list[Demonstration]:
    """The demonstrations of one file; raises DataError naming the file and row."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: demonstration file not found")
    required = {prompt_key: "set sft.prompt_key to the prompt column",
                response_key: "set sft.response_key to the response column"}
    demonstrations = []
    for where, row in iter_rows(path, (prompt_key, response_key), required):
        try:
            demonstrations.append(_demonstration(row, prompt_key, response_key))
        except BadRow as problem:
            raise DataError(f"{where}: {problem}") from None
    if not demonstrations:
        raise DataError(f"{path}: the file has no rows")
    return demonstrations


def _demonstration(row, prompt_key: str, response_key: str) -> Demonstration:
    if isinstance(row, BadRow):
        raise row
    if not isinstance(row, dict):
        raise BadRow(f"a row must be a JSON object, not {type(row).__name__}")
    for key in (prompt_key, response_key):
        if row.get(key) is None:
            raise BadRow(f"no {key!r} column (the row has {sorted(row)})")
    response = row[response_key]
    if not isinstance(response, str) or not response.strip():
        raise BadRow(f"{response_key!r} must be non-empty text, not {response!r:.80}")
    return Demonstration(check_prompt(row[prompt_key]), response)


def encode_demonstrations(demonstrations: list[Demonstration], tokenizer, chat_template: str,
                          max_length: int) -> EncodedDemonstrations:
    """Tokenize every example; drop (and count) those longer than `max_length`."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError(f"tokenizer {tokenizer.name_or_path!r} has no end-of-sequence token; "
                        "SFT appends it to every response so the model learns to stop")
    token_ids, prompt_lengths, dropped = [], [], 0
    for demonstration in demonstrations:
        prompt = encode_prompt(demonstration.prompt, tokenizer, chat_template)
        response = list(tokenizer(demonstration.response, add_special_tokens=False)["input_ids"])
        if len(prompt) + len(response) + 1 > max_length:
            dropped += 1
            continue
        token_ids.append(prompt + response + [eos])
        prompt_lengths.append(len(prompt))
    return EncodedDemonstrations(token_ids, prompt_lengths, dropped)


def load_demonstrations(paths: list[str], config: SftConfig, tokenizer,
                        chat_template: str) -> EncodedDemonstrations:
    """Read and encode the files in order (an empty list gives no examples)."""
    demonstrations = []
    for path in paths:
        demonstrations += read_demonstrations(path, config.prompt_key, config.response_key)
    return encode_demonstrations(demonstrations, tokenizer, chat_template, config.max_length)


def make_batch(examples: EncodedDemonstrations, rows: list[int], pad_id: int) -> dict:
    """Right-padded input_ids, attention_mask and loss_mask [len(rows), longest] of `rows`;
    loss_mask marks the response tokens and the end-of-sequence token."""
    return padded_batch(examples.token_ids, examples.prompt_lengths, rows, pad_id)

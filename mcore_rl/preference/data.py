"""Preference pairs: rows read, checked, tokenized and batched, for the reward model and DPO.

Rows follow TRL's and verl's pair layout: `prompt` (text or chat messages), `chosen` and
`rejected` (text, or the assistant's chat messages that follow the prompt). Prompts are encoded
exactly as RL and SFT encode them; a text response gets the end-of-sequence token appended (as
SFT does), a chat response is encoded by the tokenizer's chat template after the prompt's
messages. Sequence 2i of the encoded pairs is pair i's chosen response, 2i + 1 its rejected
one, so a micro-batch of whole pairs is a run of consecutive sequences.

Every row problem stops the load with the file and line before the first step; pairs whose
two responses are identical carry no preference and are counted and skipped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Union

from mcore_rl.config.preference import PairDataConfig
from mcore_rl.data.encode import encode_prompt
from mcore_rl.data.files import iter_rows
from mcore_rl.data.records import BadRow, DataError, Messages, Prompt, check_messages, check_prompt
from mcore_rl.data.sequences import padded_batch

Response = Union[str, Messages]


@dataclass(frozen=True)
class PreferencePair:
    """One prompt with a preferred and a dispreferred response."""

    prompt: Prompt
    chosen: Response
    rejected: Response


@dataclass(frozen=True)
class ReadPairs:
    """The usable pairs of some files, and how many rows were skipped as identical."""

    pairs: list[PreferencePair]
    identical: int
    """Rows whose chosen and rejected responses are the same (no preference to learn)."""


@dataclass(frozen=True)
class EncodedPairs:
    """Token ids of prompt + response per sequence (2i: pair i chosen, 2i + 1: rejected) and
    where each response starts."""

    token_ids: list[list[int]]
    prompt_lengths: list[int]
    dropped_too_long: int
    """Pairs with a sequence over max_length, left out."""
    truncated: int
    """Pairs with a response cut to max_length (overlong=truncate)."""
    identical: int
    """Rows skipped because chosen == rejected."""

    @property
    def num_pairs(self) -> int:
        """Pairs kept."""
        return len(self.token_ids) // 2


def read_pairs(path: str, config: PairDataConfig) -> ReadPairs:
    """The pairs of one file; raises DataError naming the file and row."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: preference file not found")
    section = config.SECTION
    keys = (config.prompt_key, config.chosen_key, config.rejected_key)
    required = {key: f"set {section}.{field} to the {what} column" for key, field, what in
                zip(keys, ("prompt_key", "chosen_key", "rejected_key"),
                    ("prompt", "preferred response", "dispreferred response"))}
    pairs, identical, rows = [], 0, 0
    for where, row in iter_rows(path, keys, required):
        rows += 1
        try:
            pair = _pair(row, *keys)
        except BadRow as problem:
            raise DataError(f"{where}: {problem}") from None
        if pair.chosen == pair.rejected:
            identical += 1
        else:
            pairs.append(pair)
    if not rows:
        raise DataError(f"{path}: the file has no rows")
    return ReadPairs(pairs, identical)


def _pair(row: Any, prompt_key: str, chosen_key: str, rejected_key: str) -> PreferencePair:
    if isinstance(row, BadRow):
        raise row
    if not isinstance(row, dict):
        raise BadRow(f"a row must be a JSON object, not {type(row).__name__}")
    for key in (prompt_key, chosen_key, rejected_key):
        if row.get(key) is None:
            raise BadRow(f"no {key!r} column (the row has {sorted(row)})")
    return PreferencePair(check_prompt(row[prompt_key]), _response(row[chosen_key], chosen_key),
                          _response(row[rejected_key], rejected_key))


def _response(value: Any, key: str) -> Response:
    """Non-blank text, or chat messages (dicts with string role and content)."""
    if isinstance(value, str):
        if not value.strip():
            raise BadRow(f"{key!r} must be non-empty text or chat messages, not {value!r}")
        return value
    if isinstance(value, (list, tuple)):
        try:
            return check_messages(value)
        except BadRow as problem:
            raise BadRow(f"{key!r}: {problem}") from None
    raise BadRow(f"{key!r} must be text or a list of chat messages, not {type(value).__name__}")


def encode_pairs(read: ReadPairs, tokenizer, chat_template: str,
                 config: PairDataConfig) -> EncodedPairs:
    """Tokenize every pair; pairs over config.max_length are dropped or truncated (counted)."""
    if tokenizer.eos_token_id is None:
        raise DataError(f"tokenizer {tokenizer.name_or_path!r} has no end-of-sequence token; "
                        "text responses end with it")
    token_ids, prompt_lengths, dropped, truncated = [], [], 0, 0
    for pair in read.pairs:
        prompt, chosen, rejected = _encode_pair(pair, tokenizer, chat_template)
        fitted = _fit(len(prompt), (chosen, rejected), config)
        if fitted is None:
            dropped += 1
            continue
        truncated += fitted != [chosen, rejected]
        for response in fitted:
            token_ids.append(prompt + response)
            prompt_lengths.append(len(prompt))
    return EncodedPairs(token_ids, prompt_lengths, dropped, truncated, read.identical)


def _encode_pair(pair: PreferencePair, tokenizer, chat_template: str):
    """(prompt ids, chosen response ids, rejected response ids)."""
    chat = not (isinstance(pair.chosen, str) and isinstance(pair.rejected, str))
    prompt = encode_prompt(pair.prompt, tokenizer, "true" if chat and chat_template != "false"
                           else chat_template)
    return prompt, _encode_response(pair.prompt, prompt, pair.chosen, tokenizer), \
        _encode_response(pair.prompt, prompt, pair.rejected, tokenizer)


def _encode_response(prompt: Prompt, prompt_ids: list[int], response: Response,
                     tokenizer) -> list[int]:
    if isinstance(response, str):
        return list(tokenizer(response, add_special_tokens=False)["input_ids"]) \
            + [tokenizer.eos_token_id]
    messages = ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt)
    full = tokenizer.apply_chat_template(messages + response, tokenize=True,
                                         add_generation_prompt=False)
    full = list(full["input_ids"] if hasattr(full, "keys") else full)
    if full[:len(prompt_ids)] != prompt_ids:
        raise DataError(f"tokenizer {tokenizer.name_or_path!r}: its chat template does not "
                        "encode a conversation as the prompt (with the generation prompt) "
                        "followed by the response; use text responses")
    return full[len(prompt_ids):]


def _fit(prompt_length: int, responses: tuple[list[int], list[int]],
         config: PairDataConfig) -> list[list[int]] | None:
    """The responses cut to fit max_length (overlong=truncate), or None when the pair is
    dropped."""
    room = config.max_length - prompt_length
    if all(len(response) <= room for response in responses):
        return list(responses)
    if config.overlong != "truncate" or room < 1:
        return None
    return [response[:room] for response in responses]


def load_pairs(paths: list[str], config: PairDataConfig, tokenizer,
               chat_template: str) -> EncodedPairs:
    """Read and encode the files in order (an empty list gives no pairs)."""
    pairs, identical = [], 0
    for path in paths:
        read = read_pairs(path, config)
        pairs += read.pairs
        identical += read.identical
    return encode_pairs(ReadPairs(pairs, identical), tokenizer, chat_template, config)


def make_pair_batch(encoded: EncodedPairs, pairs: list[int], pad_id: int) -> dict:
    """The sequences of `pairs`, chosen then rejected for each pair in turn (right-padded
    input_ids, attention_mask, and loss_mask over the responses)."""
    rows = [row for pair in pairs for row in (2 * pair, 2 * pair + 1)]
    return padded_batch(encoded.token_ids, encoded.prompt_lengths, rows, pad_id)

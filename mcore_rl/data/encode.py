"""Prompts -> token ids, once, at load time, with the model's own chat template.

Encoding the whole dataset before training means a prompt that cannot be encoded (chat messages
for a tokenizer without a chat template) fails the job before any rollout, and prompts over the
length limit are dropped and counted up front instead of being refused mid-run by the engine.

Chat messages go through `tokenizer.apply_chat_template(..., add_generation_prompt=True)`, so the
ids are exactly what the tokenizer's own template gives. Text is encoded with the tokenizer's
defaults (`add_special_tokens=True`: a BOS where the tokenizer adds one, as vLLM and HF generate
do for a raw text prompt); apply_chat_template=true wraps it as one user message instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, Union

from mcore_rl.config.data import CHAT_TEMPLATE_MODES

from .records import DataError, Prompt, PromptRecord


@dataclass(frozen=True)
class EncodedPrompts:
    """The prompts kept after encoding, in dataset order; position i of `token_ids` belongs to
    `records[i]` (the sampler's indices are positions in these lists)."""

    token_ids: list[list[int]]
    """Prompt token ids, each at most max_prompt_tokens long."""

    records: list[PromptRecord]
    """The records kept (their `index` is still their position in the loaded dataset)."""

    dropped_too_long: int
    """Prompts dropped for having more than max_prompt_tokens tokens."""


def encode_prompts(records: Sequence[PromptRecord], tokenizer, max_prompt_tokens: int,
                   apply_chat_template: Union[str, bool] = "auto") -> EncodedPrompts:
    """Encode every record; drop (and count) those longer than `max_prompt_tokens`.
    `apply_chat_template` is "auto", "true"/True or "false"/False (see DataConfig). Raises
    DataError naming the record when a prompt cannot be encoded."""
    mode = chat_template_mode(apply_chat_template)
    if max_prompt_tokens < 1:
        raise DataError(f"max_prompt_tokens={max_prompt_tokens} must be at least 1")
    kept_ids, kept_records, dropped = [], [], 0
    for record in records:
        ids = encode_prompt(record.prompt, tokenizer, mode)
        if not ids:
            raise DataError(f"prompt {record.index} ({record.data_source}) encodes to no tokens")
        if len(ids) > max_prompt_tokens:
            dropped += 1
            continue
        kept_ids.append(ids)
        kept_records.append(record)
    return EncodedPrompts(kept_ids, kept_records, dropped)


def chat_template_mode(value: Union[str, bool]) -> str:
    """"auto", "true" or "false" from a bool or a string in any case."""
    mode = str(value).strip().lower()
    if mode not in CHAT_TEMPLATE_MODES:
        raise DataError(f"apply_chat_template={value!r} must be one of "
                        f"{', '.join(CHAT_TEMPLATE_MODES)}")
    return mode


def encode_prompt(prompt: Prompt, tokenizer, mode: str = "auto") -> list[int]:
    """Token ids of one prompt under chat-template `mode` (auto/true/false)."""
    if isinstance(prompt, str) and mode != "true":
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if mode == "false":
        raise DataError("a prompt is chat messages but data.apply_chat_template=false; use "
                        "auto (the tokenizer's chat template) or text prompts")
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"tokenizer {tokenizer.name_or_path!r} has no chat template, but the "
                        "prompts are chat messages (or apply_chat_template=true); use a "
                        "tokenizer with one (data.tokenizer), or text prompts with "
                        "data.apply_chat_template=auto")
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return _token_list(encoded)


def _token_list(encoded: Any) -> list[int]:
    """apply_chat_template returns a BatchEncoding in transformers 5, a list of ids before."""
    if hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    return [int(token) for token in encoded]

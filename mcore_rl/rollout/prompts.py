"""Check and shape prompt token ids before they reach an engine.

Engines fail late and unclearly on bad prompts (an empty prompt, or one longer than the context,
surfaces as an error deep inside a batch, or a silent truncation). So every engine's prompts go
through `prepare_prompts` first: the batch is refused with the offending index and length, or
truncated as configured and counted, before any generation starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from mcore_rl.config.rollout import PromptConfig, SamplingConfig


class PromptError(ValueError):
    """A prompt batch the engine must not start on."""


@dataclass(frozen=True)
class PreparedPrompts:
    """Prompts ready for an engine, and what was done to them."""

    token_ids: list[list[int]]
    """One list of token ids per prompt, in the caller's order."""

    truncated: int
    """How many prompts were shortened to ``max_prompt_tokens``."""


def prepare_prompts(prompts: Sequence[Sequence[int]], config: PromptConfig,
                    vocab_size: int) -> PreparedPrompts:
    """Validate ``prompts`` (lists of token ids) and truncate overlong ones per ``config``.
    Raises PromptError naming every empty prompt, every out-of-vocabulary token's prompt, and
    (with ``overlong="error"``) every overlong prompt by index and length."""
    if not prompts:
        raise PromptError("no prompts were given")
    problems, prepared, truncated = [], [], 0
    limit = config.max_prompt_tokens
    for index, prompt in enumerate(prompts):
        ids = [int(token) for token in prompt]
        if not ids:
            problems.append(f"prompt {index} is empty")
            continue
        outside = [token for token in ids if not 0 <= token < vocab_size]
        if outside:
            problems.append(f"prompt {index} has token ids outside [0, {vocab_size}): "
                            f"{outside[:5]}")
        if len(ids) > limit:
            if config.overlong == "error":
                problems.append(f"prompt {index} has {len(ids)} tokens, more than "
                                f"max_prompt_tokens={limit}")
            else:
                ids = ids[-limit:] if config.overlong == "left" else ids[:limit]
                truncated += 1
        prepared.append(ids)
    if problems:
        raise PromptError("prompts refused before generation: " + "; ".join(problems))
    return PreparedPrompts(prepared, truncated)


def check_request(sampling: SamplingConfig, prompt_config: PromptConfig,
                  context_length: int) -> None:
    """Raise PromptError naming every sampling or prompt field that is out of range, or whose
    prompt plus response cannot fit the engine's context."""
    errors = sampling.errors() + prompt_config.errors()
    longest = prompt_config.max_prompt_tokens + sampling.max_new_tokens
    if not errors and longest > context_length:
        errors.append(f"prompts.max_prompt_tokens={prompt_config.max_prompt_tokens} + "
                      f"sampling.max_new_tokens={sampling.max_new_tokens} = {longest} exceeds "
                      f"the engine's context of {context_length} tokens")
    if errors:
        raise PromptError("generation refused: " + "; ".join(errors))

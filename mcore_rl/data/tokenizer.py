"""The job's tokenizer and the token ids every trainer takes from it.

RL and SFT jobs load it the same way (data.tokenizer, else the init model's), so a model trained
by one and continued by the other sees the same ids.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from mcore_rl.config import ConfigError, InitConfig, JobConfig

from .toy import write_toy_tokenizer


def load_tokenizer(config: JobConfig):
    """data.tokenizer, else the initial HF folder's or checkpoint's; the toy task alone brings
    its own (rank 0 writes it; collective)."""
    path = config.data.tokenizer or tokenizer_folder(config.init)
    if not path and _only_toy_prompts(config):
        path = os.path.join(config.runtime.output_dir, "toy_tokenizer")
        if dist.get_rank() == 0:
            write_toy_tokenizer(path)
        dist.barrier()
    if not path:
        raise ConfigError("data.tokenizer is not set and there is no init.hf_path or init "
                          "checkpoint with a tokenizer/ folder to take the tokenizer from")
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise ConfigError(f"data.tokenizer: cannot load a tokenizer from {path}: {error}") \
            from error


def pad_id(tokenizer) -> int:
    """The id padding rows are filled with: the tokenizer's pad token, else its EOS."""
    pad = tokenizer.pad_token_id
    return tokenizer.eos_token_id if pad is None else pad


def tokenizer_folder(init: InitConfig) -> str | None:
    """The tokenizer that travels with a model: its HF folder, or an mcore_rl checkpoint's
    tokenizer/ folder; None when it has none."""
    if init.hf_path:
        return init.hf_path
    folder = os.path.join(init.checkpoint or "", "tokenizer")
    return folder if init.checkpoint and os.path.isdir(folder) else None


def vocabulary_differences(ours, theirs, names: tuple[str, str], shown: int = 3) -> list[str]:
    """How `theirs` (a tokenizer) maps tokens differently from `ours`, naming the first
    `shown` tokens that differ (`names`: what to call the two); empty when both map every
    token to the same id."""
    mine, other = ours.get_vocab(), theirs.get_vocab()
    differing = sorted(set(mine) ^ set(other) | {token for token in set(mine) & set(other)
                                                  if mine[token] != other[token]},
                       key=lambda token: (mine.get(token, other.get(token)), token))
    return [f"{token!r} is {_id_in(mine, token)} in {names[0]} and {_id_in(other, token)} in "
            f"{names[1]}" for token in differing[:shown]] + (
        [f"... {len(differing) - shown} more tokens differ"] if len(differing) > shown else [])


def _id_in(vocabulary: dict, token: str) -> str:
    return f"id {vocabulary[token]}" if token in vocabulary else "absent"


def _only_toy_prompts(config: JobConfig) -> bool:
    data = config.data
    return bool(data.toy.size) and not (data.train_files or data.val_files
                                        or data.reasoning_gym.tasks)

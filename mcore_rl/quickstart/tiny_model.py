"""A tiny random Llama as an HF folder: the quickstart starts where a user starts, from an HF
checkpoint, and goes through the same conversion as a 70B model."""

from __future__ import annotations

import os
import shutil

from mcore_rl.data.toy import write_word_tokenizer


def write_tiny_llama(folder: str, vocabulary: tuple[str, ...], seed: int = 0,
                     chat_template: str | None = None, hidden_size: int = 128,
                     num_layers: int = 2) -> str:
    """LlamaForCausalLM (2 layers, hidden 128, head_dim 64, the smallest vLLM's CPU attention
    takes; wider and deeper by argument, heads growing with the width) with random weights and
    a word-level tokenizer over `vocabulary` (with `chat_template`), written to `folder`
    (staged, renamed when complete)."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=len(vocabulary), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=hidden_size // 64,
        num_key_value_heads=2,
        max_position_embeddings=64, tie_word_embeddings=False,
        pad_token_id=vocabulary.index("<pad>"), eos_token_id=vocabulary.index("<eos>"),
        bos_token_id=None)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    staging = folder + ".incomplete"
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    write_word_tokenizer(staging, vocabulary, chat_template=chat_template)
    os.replace(staging, folder)
    return folder

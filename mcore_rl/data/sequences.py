"""Prompt + response token sequences as the right-padded batch every dataset job trains on.

SFT demonstrations and preference pairs both end up as (token ids, where the response starts)
per sequence; one function turns a selection of them into input_ids, attention_mask and the
loss mask over the response tokens, so the two jobs cannot disagree about padding or masks.
"""

from __future__ import annotations

import torch


def padded_batch(token_ids: list[list[int]], prompt_lengths: list[int], rows: list[int],
                 pad_id: int) -> dict:
    """Right-padded input_ids, attention_mask and loss_mask [len(rows), longest] of sequences
    `rows`; loss_mask marks each sequence's tokens from its prompt length on."""
    width = max(len(token_ids[row]) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for position, row in enumerate(rows):
        ids = token_ids[row]
        input_ids[position, :len(ids)] = torch.tensor(ids)
        attention_mask[position, :len(ids)] = 1
        loss_mask[position, prompt_lengths[row]:len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}

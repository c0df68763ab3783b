"""Token batches as the model runner sees them: right-padded [n, s] tensors with a validity mask.

All sequences start at position 0 and padding is only at the end, so causal attention alone
keeps padding from influencing real tokens (no attention mask needed, the same with Transformer
Engine's causal kernels), and outputs at padded positions are zeroed.

Per-token outputs are aligned to the token they are about: `logprobs[:, t] = log p(x_t | x_<t)`,
`entropy[:, t]` is the entropy of that distribution and `values[:, t]` the value of the state
in which x_t was chosen. Position 0 has no predecessor and is always 0.
"""

from __future__ import annotations

import torch

Batch = dict[str, torch.Tensor]


def check_batch(batch: Batch) -> None:
    """Raise ValueError naming the tensor when a batch is not [n, s] right-padded."""
    if "input_ids" not in batch or "attention_mask" not in batch:
        raise ValueError(f"batch needs 'input_ids' and 'attention_mask', got {sorted(batch)}")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    if ids.dim() != 2 or mask.shape != ids.shape:
        raise ValueError(f"input_ids {tuple(ids.shape)} and attention_mask {tuple(mask.shape)} "
                         "must both be [num_sequences, seq_length]")
    for name, tensor in batch.items():
        if tensor.shape[0] != ids.shape[0]:
            raise ValueError(f"batch tensor '{name}' has {tensor.shape[0]} rows, "
                             f"input_ids has {ids.shape[0]}")
    lengths = mask.sum(dim=1)
    expected = torch.arange(ids.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
    if not torch.equal(mask.bool(), expected.to(mask.device)):
        raise ValueError("attention_mask must be right-padded: ones, then only zeros")


def split_micro_batches(batch: Batch, micro_batch_size: int) -> list[Batch]:
    """Consecutive micro-batches of `micro_batch_size` rows (the row count must divide)."""
    rows = batch["input_ids"].shape[0]
    if rows % micro_batch_size:
        raise ValueError(f"{rows} sequences cannot be split into micro-batches of "
                         f"{micro_batch_size}")
    return [{name: tensor[start:start + micro_batch_size] for name, tensor in batch.items()}
            for start in range(0, rows, micro_batch_size)]


def pad_rows_to_multiple(batch: Batch, multiple: int) -> Batch:
    """The batch with copies of its last row appended until the row count is a multiple of
    `multiple` (pipeline schedules need equal micro-batches); slice outputs back to the
    original count."""
    rows = batch["input_ids"].shape[0]
    missing = -rows % multiple
    if missing == 0:
        return batch
    return {name: torch.cat([tensor, tensor[-1:].expand(missing, *tensor.shape[1:])])
            for name, tensor in batch.items()}


def shard_for_data_parallel(batch: Batch, dp_rank: int, dp_size: int) -> Batch:
    """The contiguous share of rows that data-parallel rank `dp_rank` trains on."""
    rows = batch["input_ids"].shape[0]
    if rows % dp_size:
        raise ValueError(f"{rows} sequences cannot be split over {dp_size} data-parallel ranks")
    share = rows // dp_size
    return {name: tensor[dp_rank * share:(dp_rank + 1) * share] for name, tensor in batch.items()}


def align_to_tokens(per_position: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Shift [b, s] outputs computed at position t-1 to position t, zeroing position 0 and
    padding."""
    aligned = torch.zeros_like(per_position)
    aligned[:, 1:] = per_position[:, :-1]
    valid = attention_mask.bool().clone()
    valid[:, 0] = False
    return torch.where(valid, aligned, torch.zeros_like(aligned))

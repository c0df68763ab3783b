"""Token batches as the model runner sees them: right-padded [n, s] tensors with a validity mask.

All sequences start at position 0 and padding is only at the end, so causal attention alone
keeps padding from influencing real tokens (no attention mask needed, the same with Transformer
Engine's causal kernels), and outputs at padded positions are zeroed.

Per-token outputs are aligned to the token they are about: `logprobs[:, t] = log p(x_t | x_<t)`,
`entropy[:, t]` is the entropy of that distribution and `values[:, t]` the value of the state
in which x_t was chosen. Position 0 has no predecessor and is always 0.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    expected = torch.arange(ids.shape[1], device=mask.device).unsqueeze(0) < lengths.unsqueeze(1)
    if not torch.equal(mask.bool(), expected):
        raise ValueError("attention_mask must be right-padded: ones, then only zeros")


def split_micro_batches(batch: Batch, micro_batch_size: int) -> list[Batch]:
    """Consecutive micro-batches of `micro_batch_size` rows (the row count must divide)."""
    rows = batch["input_ids"].shape[0]
    if rows % micro_batch_size:
        raise ValueError(f"{rows} sequences cannot be split into micro-batches of "
                         f"{micro_batch_size}")
    return [{name: tensor[start:start + micro_batch_size] for name, tensor in batch.items()}
            for start in range(0, rows, micro_batch_size)]


def token_budget_micro_batches(batch: Batch, max_tokens: int, length_multiple: int = 1
                               ) -> tuple[list[Batch], torch.Tensor]:
    """Micro-batches of at most `max_tokens` padded tokens each (rows x the micro-batch's
    longest row), instead of a fixed row count: rows sorted longest first are packed greedily,
    and each micro-batch is cut to its own longest row (rounded up to `length_multiple`), so
    short responses neither waste compute on padding nor leave the budget underused. Returns
    the micro-batches and `order`: their rows, concatenated, are `batch` rows `order`."""
    lengths = batch["attention_mask"].sum(dim=1)
    order = torch.sort(lengths, descending=True, stable=True).indices
    width = batch["input_ids"].shape[1]

    def padded_length(length: int) -> int:
        return min(-(-length // length_multiple) * length_multiple, width)

    groups: list[list[int]] = []
    for row in order.tolist():
        longest = padded_length(int(lengths[row]))
        if longest > max_tokens:
            raise ValueError(f"a sequence of {longest} tokens does not fit the micro-batch token "
                             f"budget of {max_tokens}")
        # Sorted longest first: a group's first row sets its width.
        if groups and (len(groups[-1]) + 1) * padded_length(int(lengths[groups[-1][0]])) \
                <= max_tokens:
            groups[-1].append(row)
        else:
            groups.append([row])
    micro_batches = []
    for rows in groups:
        cut = padded_length(int(lengths[rows[0]]))
        index = torch.tensor(rows)
        micro_batches.append({name: tensor[index, :cut] if tensor.dim() > 1 else tensor[index]
                              for name, tensor in batch.items()})
    return micro_batches, order


def packed_micro_batches(batch: Batch, max_tokens: int, length_multiple: int = 1
                         ) -> tuple[list[Batch], torch.Tensor]:
    """Micro-batches whose rows, concatenated without padding (`PackedRows`), hold at most
    `max_tokens` tokens (their total rounded up to `length_multiple`): rows sorted longest
    first go to the first micro-batch they fit (first-fit decreasing). Each micro-batch is
    still given in row form ([b, s] cut to its longest row, what loss functions read), with
    `pack_offsets` [b]: where each row starts in the packed sequence. Returns the micro-batches
    and `order`: their rows, concatenated, are `batch` rows `order`."""
    lengths = batch["attention_mask"].sum(dim=1).tolist()  # one host read per pass

    def rounded(tokens: int) -> int:
        return -(-max(tokens, 1) // length_multiple) * length_multiple

    groups: list[list[int]] = []
    used: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda row: -lengths[row]):  # stable
        if rounded(lengths[row]) > max_tokens:
            raise ValueError(f"a sequence of {rounded(lengths[row])} tokens does not fit the "
                             f"micro-batch token budget of {max_tokens}")
        fits = next((index for index, total in enumerate(used)
                     if rounded(total + lengths[row]) <= max_tokens), None)
        if fits is None:
            groups.append([]), used.append(0)
            fits = len(groups) - 1
        groups[fits].append(row)
        used[fits] += lengths[row]
    micro_batches = []
    for rows in groups:
        cut = max(1, lengths[rows[0]])
        index = torch.tensor(rows)
        micro_batch = {name: tensor[index, :cut] if tensor.dim() > 1 else tensor[index]
                       for name, tensor in batch.items()}
        offsets = [0]
        for row in rows[:-1]:
            offsets.append(offsets[-1] + lengths[row])
        micro_batch["pack_offsets"] = torch.tensor(offsets)
        micro_batches.append(micro_batch)
    return micro_batches, torch.tensor([row for rows in groups for row in rows],
                                       dtype=torch.long)


@dataclass
class PackedRows:
    """How a row-form micro-batch ([b, s], right-padded) is laid out as one packed sequence
    [1, t]: rows back to back, then (when the total is not a multiple of what context or
    sequence parallelism needs) one padding segment. Built on the host from host tensors (no
    device synchronisation), its index tensors moved once per micro-batch (`to`)."""

    lengths: tuple[int, ...]
    """Each row's tokens."""
    segments: tuple[int, ...]
    """The packed sequence's segments: the rows' lengths and the final padding, if any."""
    length: int
    """t: the packed sequence's length (a multiple of the length multiple)."""
    gather: torch.Tensor
    """[t] long: the flat row-form position ([b x s]) of each packed position (padding: 0)."""
    scatter: torch.Tensor
    """[b, s] long: the packed position of each row-form position (padding: 0)."""

    @classmethod
    def of(cls, micro_batch: Batch, length_multiple: int = 1) -> "PackedRows":
        rows, width = micro_batch["input_ids"].shape
        lengths = micro_batch["attention_mask"].sum(dim=1).tolist()
        total = sum(lengths)
        length = -(-max(total, 1) // length_multiple) * length_multiple
        segments = tuple(value for value in lengths if value) + \
            ((length - total,) if length > total else ())
        offsets = torch.tensor([0] + lengths).cumsum(0)
        columns = torch.arange(width)
        scatter = offsets[:-1, None] + columns[None, :]
        valid = columns[None, :] < torch.tensor(lengths)[:, None]
        gather = torch.zeros(length, dtype=torch.long)
        gather[scatter[valid]] = (torch.arange(rows)[:, None] * width + columns[None, :])[valid]
        return cls(tuple(lengths), segments, length, gather,
                   torch.where(valid, scatter, torch.zeros_like(scatter)))

    def to(self, device) -> "PackedRows":
        return PackedRows(self.lengths, self.segments, self.length,
                          self.gather.to(device, non_blocking=True),
                          self.scatter.to(device, non_blocking=True))

    def cu_seqlens(self, device=None) -> torch.Tensor:
        """[segments + 1] int32 cumulative segment lengths (the padding is a segment of its
        own, so that its positions attend only among themselves)."""
        return torch.tensor((0, *self.segments), dtype=torch.int32).cumsum(0, dtype=torch.int32
                                                                          ).to(device)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """Row-form [b, s, ...] -> packed [1, t, ...]."""
        return tensor.reshape(-1, *tensor.shape[2:])[self.gather].unsqueeze(0)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """Packed [1, t, ...] -> row-form [b, s, ...] (padding positions hold any value)."""
        return packed[0][self.scatter]


def pad_columns_to_multiple(batch: Batch, multiple: int, fill: dict[str, int] | None = None
                            ) -> Batch:
    """The batch with padding columns appended (0, or `fill[name]`; every mask 0) until its
    sequence length is a multiple of `multiple` (context and sequence parallelism split it
    evenly)."""
    width = batch["input_ids"].shape[1]
    missing = -width % multiple
    if missing == 0:
        return batch
    fill = fill or {}
    return {name: torch.cat([tensor, tensor.new_full((tensor.shape[0], missing,
                                                      *tensor.shape[2:]), fill.get(name, 0))],
                            dim=1)
            if tensor.dim() > 1 else tensor for name, tensor in batch.items()}


def pad_rows_to_multiple(batch: Batch, multiple: int) -> Batch:
    """The batch with copies of its last row appended until the row count is a multiple of
    `multiple` (pipeline schedules need equal micro-batches); slice outputs back to the
    original count."""
    rows = batch["input_ids"].shape[0]
    return pad_rows_to(batch, rows - rows % -multiple)


def pad_rows_to(batch: Batch, total: int) -> Batch:
    """The batch with copies of its last row appended up to `total` rows."""
    missing = total - batch["input_ids"].shape[0]
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


def with_score_slot(batch: Batch) -> tuple[Batch, torch.Tensor]:
    """The batch with one more valid position per row, and that position [n]. Per-token outputs
    are aligned to the token after the one that produced them, so the output slot of the extra
    position holds the model's output at the row's last real token (causal attention keeps the
    extra token (id 0) from changing anything before it): a scalar head's
    sequence score, read as transformers' `...ForSequenceClassification` reads it."""
    lengths = batch["attention_mask"].sum(dim=1)
    rows = torch.arange(len(lengths), device=lengths.device)
    extended = {name: torch.nn.functional.pad(tensor, (0, 1)) if tensor.dim() == 2 else tensor
                for name, tensor in batch.items()}
    extended["attention_mask"][rows, lengths] = 1
    return extended, lengths

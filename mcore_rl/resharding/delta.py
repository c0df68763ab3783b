"""A shard's change since the copy a rollout rank holds, in the fewest bytes (issue 66's encoding).

After an optimizer step at RL learning rates most weights of a bf16 shard round to the value
they had: the sync can send only the elements whose bit pattern changed. Which elements changed
is said in whichever of three forms is smallest for the tensor at hand:

- ``runs``: the start and length of each run of changed elements (int64 + int32 each), then the
  changed values: best when the changes cluster (a row of an embedding, an adapter's block);
- ``mask``: one bit per element, then the changed values: best when changes are scattered;
- ``full``: the whole tensor, when neither is smaller (most weights changed).

Equality is of bit patterns in the engine's dtype (integer views), so NaN payloads and the sign
of zero travel exactly, and applying a delta to the copy it was computed against gives the new
tensor bitwise. On the wire a delta is one byte buffer (`to_wire`) whose layout the receiver
rebuilds from three integers (`Delta.header`) and the message's element count it knows from the
plan (`from_wire`). Pure torch: no process group, no engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KINDS = ("full", "runs", "mask")

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""Integer dtype of each element size: the views compared bit for bit."""

HEADER_LENGTH = 3
"""Integers in a delta's header (`header`)."""

_RUN_BYTES = 8 + 4
"""What one run costs besides its values: an int64 start and an int32 length."""


@dataclass(frozen=True)
class Delta:
    """What changed in one tensor: its form (one of KINDS), its element count and the tensors
    that carry it (``full``: (values,); ``runs``: (starts, lengths, values); ``mask``: (bits,
    values), bits packed eight elements to a byte, lowest bit first)."""

    kind: str
    numel: int
    parts: tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        """Bytes on the wire."""
        return sum(part.numel() * part.element_size() for part in self.parts)

    @property
    def changed(self) -> int:
        """Elements it sets."""
        return self.parts[-1].numel()


def changed_elements(previous: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    """Flat boolean mask of the elements whose bit pattern differs (same shape and dtype)."""
    if previous.shape != current.shape or previous.dtype != current.dtype:
        raise ValueError(f"a delta needs equal shapes and dtypes: {tuple(previous.shape)} "
                         f"{previous.dtype} vs {tuple(current.shape)} {current.dtype}")
    bits = _BITS[current.element_size()]
    return (previous.reshape(-1).view(bits) != current.reshape(-1).view(bits))


def encode_delta(previous: torch.Tensor, current: torch.Tensor) -> Delta:
    """The smallest form of `current`'s change from `previous` (ties go to the earlier of
    full, runs, mask). A full delta shares `current`'s memory. Two passes over the tensor (the
    comparison and its nonzero); the runs come from the changed indices alone."""
    flat = current.reshape(-1)
    changed = changed_elements(previous, current)
    where = changed.nonzero().flatten()
    starts, lengths = _runs(where)
    element = flat.element_size()
    sizes = {"full": flat.numel() * element,
             "runs": starts.numel() * _RUN_BYTES + where.numel() * element,
             "mask": -(-flat.numel() // 8) + where.numel() * element}
    kind = min(KINDS, key=lambda name: sizes[name])
    if kind == "full":
        return Delta("full", flat.numel(), (flat,))
    values = flat[where]
    if kind == "runs":
        return Delta("runs", flat.numel(), (starts, lengths.to(torch.int32), values))
    return Delta("mask", flat.numel(), (_pack_bits(changed), values))


def apply_delta(target: torch.Tensor, delta: Delta) -> None:
    """Set `target`'s changed elements in place (it must hold the copy the delta was computed
    against)."""
    if target.numel() != delta.numel:
        raise ValueError(f"a delta of {delta.numel} elements cannot apply to a tensor of "
                         f"{target.numel()}")
    flat = target.view(-1)
    values = delta.parts[-1].to(device=flat.device, dtype=flat.dtype)
    if delta.kind == "full":
        flat.copy_(values)
    elif delta.kind == "runs":
        starts, lengths = (part.to(flat.device) for part in delta.parts[:2])
        flat[_run_indices(starts, lengths.long())] = values
    else:
        flat[_unpack_bits(delta.parts[0].to(flat.device), delta.numel)] = values


def full_delta(current: torch.Tensor) -> Delta:
    """The whole tensor as a delta (a first sync, an anchor), sharing its memory."""
    return Delta("full", current.numel(), (current.reshape(-1),))


# -- on the wire ----------------------------------------------------------------------------

def header(delta: Delta) -> list[int]:
    """What the receiver needs besides the element count and dtype to read the wire buffer:
    the form's index in KINDS, the number of runs and the number of changed elements."""
    runs = delta.parts[0].numel() if delta.kind == "runs" else 0
    return [KINDS.index(delta.kind), runs, delta.changed]


def _part_specs(kind: str, numel: int, runs: int, changed: int,
                dtype: torch.dtype) -> list[tuple[torch.dtype, int]]:
    """(dtype, count) of each part, in `Delta.parts` order."""
    if kind == "full":
        return [(dtype, numel)]
    if kind == "runs":
        return [(torch.int64, runs), (torch.int32, runs), (dtype, changed)]
    return [(torch.uint8, -(-numel // 8)), (dtype, changed)]


def _wire_order(specs: list[tuple[torch.dtype, int]]) -> list[int]:
    """Parts by element size, largest first: every part then starts at a multiple of its own
    element size, so the receiver views its slice of the byte buffer without a copy."""
    return sorted(range(len(specs)), key=lambda index: -specs[index][0].itemsize)


def wire_bytes(header_values: list[int], numel: int, dtype: torch.dtype) -> int:
    """Size of the wire buffer a header announces."""
    kind, runs, changed = header_values
    return sum(d.itemsize * count for d, count in _part_specs(KINDS[kind], numel, runs, changed,
                                                               dtype))


def to_wire(delta: Delta) -> torch.Tensor:
    """The delta as one flat uint8 buffer (a full delta's without a copy)."""
    specs = [(part.dtype, part.numel()) for part in delta.parts]
    parts = [delta.parts[index].reshape(-1).view(torch.uint8) for index in _wire_order(specs)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def from_wire(header_values: list[int], numel: int, dtype: torch.dtype,
              buffer: torch.Tensor) -> Delta:
    """The delta a `to_wire` buffer holds (views into `buffer`)."""
    kind, runs, changed = header_values
    specs = _part_specs(KINDS[kind], numel, runs, changed, dtype)
    parts: list = [None] * len(specs)
    offset = 0
    for index in _wire_order(specs):
        part_dtype, count = specs[index]
        size = part_dtype.itemsize * count
        parts[index] = buffer[offset:offset + size].view(part_dtype)
        offset += size
    if offset != buffer.numel():
        raise ValueError(f"a delta buffer of {buffer.numel()} bytes, its header announces "
                         f"{offset}")
    return Delta(KINDS[kind], numel, tuple(parts))


def checksums(flat: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """One int64 per consecutive segment of `counts` elements of `flat`: the sum of each
    element's bit pattern times its position in the segment plus one, wrapping. Integer
    arithmetic, so the same on every device; a changed, moved or swapped element shows."""
    bits = flat.view(_BITS[flat.element_size()]).to(torch.int64)
    sums, offset = [], 0
    for count in counts:
        weights = torch.arange(1, count + 1, dtype=torch.int64, device=flat.device)
        sums.append((bits[offset:offset + count] * weights).sum())
        offset += count
    return torch.stack(sums) if sums else bits.new_zeros(0)


def _runs(where: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts, lengths) of the runs of consecutive indices in a sorted index tensor."""
    first = torch.ones(min(1, where.numel()), dtype=torch.bool, device=where.device)
    opens = torch.cat([first, torch.diff(where) != 1]).nonzero().flatten()
    ends = torch.cat([opens[1:], opens.new_tensor([where.numel()])]) if opens.numel() else opens
    return where[opens], ends - opens


def _run_indices(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The element indices the runs cover, in order."""
    if starts.numel() == 0:
        return starts
    offsets = torch.arange(int(lengths.sum()), device=starts.device)
    first = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
    return torch.repeat_interleave(starts, lengths) + offsets - first


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A flat boolean mask, eight elements to a uint8, lowest bit first."""
    padded = torch.nn.functional.pad(mask.to(torch.uint8), (0, -mask.numel() % 8))
    weights = (2 ** torch.arange(8, device=mask.device)).to(torch.uint8)
    return (padded.view(-1, 8) * weights).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def _unpack_bits(bits: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of `_pack_bits` (the first `numel` elements)."""
    shifts = torch.arange(8, device=bits.device, dtype=torch.uint8)
    return ((bits[:, None] >> shifts) & 1).to(torch.bool).reshape(-1)[:numel]

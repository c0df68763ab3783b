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
tensor bitwise. Pure torch: no process group, no engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KINDS = ("full", "runs", "mask")

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""Integer dtype of each element size: the views compared bit for bit."""

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
    full, runs, mask)."""
    flat = current.reshape(-1)
    changed = changed_elements(previous, current)
    values = flat[changed]
    starts, lengths = _runs(changed)
    element = flat.element_size()
    sizes = {"full": flat.numel() * element,
             "runs": starts.numel() * _RUN_BYTES + values.numel() * element,
             "mask": -(-flat.numel() // 8) + values.numel() * element}
    kind = min(KINDS, key=lambda name: sizes[name])
    if kind == "full":
        return Delta("full", flat.numel(), (flat.clone(),))
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


def _runs(changed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts, lengths) of the runs of True in a flat boolean mask."""
    edges = torch.diff(changed.to(torch.int8), prepend=changed.new_zeros(1, dtype=torch.int8),
                       append=changed.new_zeros(1, dtype=torch.int8))
    starts = (edges == 1).nonzero().flatten()
    ends = (edges == -1).nonzero().flatten()
    return starts, ends - starts


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

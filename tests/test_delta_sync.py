"""The delta encoding of a shard's change (resharding/delta.py) against its definition: applied
to the copy it was computed from it gives the new tensor bit for bit, and its form is the
smallest of the three, sizes counted by a slow obvious walk over the elements."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.resharding.delta import apply_delta, encode_delta

BITS = {torch.bfloat16: torch.int16, torch.float32: torch.int32}


def _slow_sizes(previous: torch.Tensor, current: torch.Tensor) -> dict[str, int]:
    """Bytes of each form, by walking the elements one by one."""
    bits = BITS[current.dtype]
    old, new = previous.reshape(-1).view(bits).tolist(), current.reshape(-1).view(bits).tolist()
    changed = [a != b for a, b in zip(old, new)]
    runs = sum(1 for index, flag in enumerate(changed)
               if flag and (index == 0 or not changed[index - 1]))
    element = current.element_size()
    count = sum(changed)
    return {"full": len(new) * element, "runs": runs * 12 + count * element,
            "mask": -(-len(new) // 8) + count * element}


def _changed(previous: torch.Tensor, density: float, clustered: bool, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    current = previous.clone().reshape(-1)
    count = int(density * current.numel())
    if clustered:
        start = int(torch.randint(0, current.numel() - count + 1, (1,), generator=generator))
        where = torch.arange(start, start + count)
    else:
        where = torch.randperm(current.numel(), generator=generator)[:count]
    current[where] += torch.randn(count, generator=generator).to(current.dtype)
    return current.reshape(previous.shape)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("density, clustered, kind", [
    (0.0, False, "runs"), (0.02, True, "runs"), (0.05, False, "mask"), (0.9, False, "mask"),
    (1.0, False, "full")])
def test_a_delta_restores_the_new_shard_bitwise_in_its_smallest_form(dtype, density, clustered,
                                                                      kind):
    previous = torch.randn(37, 53, generator=torch.Generator().manual_seed(1)).to(dtype)
    current = _changed(previous, density, clustered, seed=2)
    delta = encode_delta(previous, current)
    sizes = _slow_sizes(previous, current)
    assert (delta.kind, delta.nbytes) == (kind, min(sizes.values())), sizes
    held = previous.clone()
    apply_delta(held, delta)
    assert torch.equal(held.view(BITS[dtype]), current.view(BITS[dtype]))


def test_bit_patterns_not_values_decide_what_is_sent():
    """-0.0 == 0.0 and NaN != NaN as floats; as bits the first pair differs and a NaN kept is
    no change. The engine must end with the trainer's exact bits."""
    previous = torch.tensor([0.0, float("nan"), 1.0, float("inf"), 2.0, 3.0, 4.0, 5.0] * 4)
    current = previous.clone()
    current[0] = -0.0
    current[9] = float("nan")  # the same NaN pattern: unchanged
    current[10] = 1.0 + 2 ** -20
    delta = encode_delta(previous, current)
    assert delta.changed == 2
    held = previous.clone()
    apply_delta(held, delta)
    assert torch.equal(held.view(torch.int32), current.view(torch.int32))


def test_a_delta_for_another_tensor_is_refused():
    with pytest.raises(ValueError, match=r"equal shapes and dtypes: \(4,\) torch.float32 vs "
                                         r"\(5,\) torch.float32"):
        encode_delta(torch.zeros(4), torch.zeros(5))
    delta = encode_delta(torch.zeros(4), torch.ones(4))
    with pytest.raises(ValueError, match="a delta of 4 elements cannot apply to a tensor of 6"):
        apply_delta(torch.zeros(6), delta)

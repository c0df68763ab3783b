"""Context parallelism's pieces on one process (models/context_parallel.py); the whole at CP2 is
in test_layout_invariance.py (TP2 x CP2, CP2 x EP2) and test_rl_learning.py (GRPO at CP2)."""

import pytest
import torch
import torch.nn.functional as F

from mcore_rl.models.context_parallel import (_sequence_order, attend_last_positions,
                                              rank_chunks, split_for_rank)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_ranks_hold_balanced_chunks_that_gather_back_in_order(cp_size):
    """Rank r holds chunks r and 2CP-1-r (each rank's causal work is equal: the chunk
    indices of every rank sum to 2CP-1); concatenating the ranks' parts in rank order and
    reordering gives the sequence back."""
    sequence = torch.arange(8 * cp_size).reshape(1, -1)
    parts = [split_for_rank(sequence, 1, rank, cp_size) for rank in range(cp_size)]
    assert all(sum(rank_chunks(rank, cp_size)) == 2 * cp_size - 1 for rank in range(cp_size))
    chunks = torch.cat(parts, dim=1).chunk(2 * cp_size, dim=1)
    restored = torch.cat([chunks[position] for position in _sequence_order(cp_size)], dim=1)
    assert torch.equal(restored, sequence)
    with pytest.raises(ValueError, match="cannot be split into 2 x CP"):
        split_for_rank(sequence[:, :-1], 1, 0, cp_size)


@pytest.mark.parametrize("lower_right", [True, False], ids=["lower-right-bias", "padded"])
def test_a_chunk_attends_like_the_whole_sequence(lower_right):
    """Queries at positions [a, a + c) over keys [0, a + c), with 4 query heads sharing 2 KV
    heads, equal rows a .. a + c of causal attention over the whole sequence (outputs and the
    gradients of queries, keys and values), in both strategies (GPU: the bias, CPU: padding)."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, 24, 8, generator=generator, requires_grad=True)
    key, value = (torch.randn(2, 2, 24, 8, generator=generator, requires_grad=True)
                  for _ in range(2))
    start, end = 12, 18
    whole = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=0.3,
                                           enable_gqa=True)[:, :, start:end]
    chunk = attend_last_positions(query[:, :, start:end], key[:, :, :end], value[:, :, :end],
                                  0.3, True, lower_right=lower_right)
    torch.testing.assert_close(chunk, whole, rtol=0, atol=1e-6)
    weights = torch.randn(whole.shape, generator=generator)
    grads = [torch.autograd.grad((out * weights).sum(), (query, key, value))
             for out in (whole, chunk)]
    for expected, got in zip(*grads):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)

"""Context parallelism: each rank of a CP group holds two chunks of every sequence.

Why two chunks: under causal attention the last positions of a sequence attend to everything
before them and the first ones to almost nothing. Cut into 2 x CP equal chunks, CP rank r holds
chunks r and 2CP-1-r, so every rank does the same attention work (Megatron's
`get_batch_on_this_cp_rank`, whose rotary embedding slices its positions the same way; TE's
CP attention expects this layout too).

Why keys and values are all-gathered: Megatron's own CP attention lives in Transformer Engine;
the local spec (models/attention.py, SDPA) has none. Llama 3 trained its long-context stage by
all-gathering keys and values within the CP group and attending each query chunk to the keys
up to its own end: one collective per layer, its backward a reduce-scatter, and attention that
stays a causal SDPA call per query chunk (`attend_last_positions`). Activations other than K/V
stay split.

Per-token outputs (log-probs, entropy, values) are small ([b, s] floats): they are gathered
back to the original order, so loss functions see whole sequences exactly as at CP1. The
gather's backward hands each rank the gradient of its own positions only (every CP rank
computes the same loss on the same gathered values; summing over the group would count each
position CP times).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rank_chunks(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two of the 2 x CP sequence chunks that CP rank `cp_rank` holds."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def split_for_rank(tensor: torch.Tensor, dim: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """The part of `tensor` (whose `dim` is the sequence, a multiple of 2 x CP) that CP rank
    `cp_rank` holds: its two chunks, concatenated."""
    if cp_size == 1:
        return tensor
    length = tensor.shape[dim]
    if length % (2 * cp_size):
        raise ValueError(f"a sequence of {length} positions cannot be split into 2 x CP = "
                         f"{2 * cp_size} equal chunks")
    chunks = tensor.chunk(2 * cp_size, dim=dim)
    first, second = rank_chunks(cp_rank, cp_size)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def _sequence_order(cp_size: int) -> list[int]:
    """Where each sequence chunk sits in the rank-major gather (rank 0's two chunks, then rank
    1's, ...): entry c is the gathered position of chunk c."""
    gathered = [chunk for rank in range(cp_size) for chunk in rank_chunks(rank, cp_size)]
    return [gathered.index(chunk) for chunk in range(2 * cp_size)]


def gather_sequence(local: torch.Tensor, group, sum_gradients: bool) -> torch.Tensor:
    """Every CP rank's [s_local, ...] part as the whole [s, ...] in sequence order (dim 0 is
    the sequence). sum_gradients: the backward reduce-scatters (each rank's result feeds a
    different computation, as keys and values do); otherwise it keeps this rank's own
    positions' gradient (every rank computes the same function of the result)."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    cp_size = group.size()
    gathered = gather_from_sequence_parallel_region(
        local.contiguous(), tensor_parallel_output_grad=sum_gradients, group=group)
    chunks = gathered.chunk(2 * cp_size, dim=0)
    return torch.cat([chunks[position] for position in _sequence_order(cp_size)], dim=0)


def gather_per_token(local: torch.Tensor, group) -> torch.Tensor:
    """Per-token outputs [b, s_local] of this CP rank as [b, s] in sequence order."""
    return gather_sequence(local.transpose(0, 1), group, sum_gradients=False).transpose(0, 1)


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group,
                     scale: float, enable_gqa: bool) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole sequence's keys.

    query, key, value: [b, heads, s_local, head_dim], s_local = this rank's two chunks.
    Returns [b, heads, s_local, head_dim] for those queries."""
    cp_size, cp_rank = group.size(), group.rank()
    # [b, h, s, d] -> sequence first for the gather, and back.
    keys, values = (gather_sequence(tensor.permute(2, 0, 1, 3), group, sum_gradients=True)
                    .permute(1, 2, 0, 3) for tensor in (key, value))
    chunk_length = query.shape[2] // 2
    contexts = []
    for half, chunk in enumerate(rank_chunks(cp_rank, cp_size)):
        end = (chunk + 1) * chunk_length  # the chunk's queries see keys up to their own
        contexts.append(attend_last_positions(
            query[:, :, half * chunk_length:(half + 1) * chunk_length], keys[:, :, :end],
            values[:, :, :end], scale, enable_gqa))
    return torch.cat(contexts, dim=2)


def attend_last_positions(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          scale: float, enable_gqa: bool,
                          lower_right: bool | None = None) -> torch.Tensor:
    """Causal attention of queries at the last positions of `keys` ([b, h, q, d] over
    [b, h, k, d], q <= k). On GPUs a lower-right causal bias, which FlashAttention and the
    memory-efficient kernel align themselves (lower_right None: when the queries are on a GPU).
    PyTorch's CPU kernels would materialise that bias as a [q, k] float mask; there the queries
    are padded in front to k positions and attend with the plain causal flag, which the CPU's
    fused kernel runs without a score matrix (more FLOPs, memory linear in k)."""
    from torch.nn.attention.bias import causal_lower_right

    query_length, key_length = queries.shape[2], keys.shape[2]
    if lower_right if lower_right is not None else queries.is_cuda:
        return F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=causal_lower_right(query_length, key_length),
            scale=scale, enable_gqa=enable_gqa)
    padded = F.pad(queries, (0, 0, key_length - query_length, 0))
    return F.scaled_dot_product_attention(padded, keys, values, is_causal=True, scale=scale,
                                          enable_gqa=enable_gqa)[:, :, key_length - query_length:]

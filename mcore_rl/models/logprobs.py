"""Per-token log-probabilities and entropy from vocab-parallel logits, without gathering them, a
chunk of positions at a time.

Each TP rank holds logits for a contiguous slice of the (padded) vocabulary. Per position, only
four numbers cross the TP group: the max, the sum of exponentials, the target's logit and the
softmax-weighted sum of the logits. Columns beyond the real vocabulary (padding for TP) take no
part, so results do not depend on the TP size.

    logp(t)  = z_t - logsumexp(z)
    H        = logsumexp(z) - sum_v softmax(z)_v * z_v

Why chunks and a hand-written backward: over a whole response autograd would keep about five
fp32 [tokens, vocab/TP] tensors (the upcast, the temperature's division, the shift, exp, and
what autograd saves), about 10 GB per sequence per rank at a 152k vocabulary, TP2 and 32k tokens:
long responses ran out of memory here, not in the transformer. The forward computes each chunk's
statistics and frees its temporaries; the backward recomputes one chunk's softmax at a time:

    d logp / dz_v = 1[v = t] - p_v          d H / dz_v = p_v (E - z_v),  E = sum_u p_u z_u

Every TP rank receives the same gradient of the loss with respect to logp and H (the loss is
computed identically on each), so each rank's slice gets exactly its share. What stays is the
gradient with respect to the logits themselves, in the logits' dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

CHUNK_TOKENS = 256
"""Positions per chunk: the fp32 temporaries of one chunk (about four at once) are CHUNK_TOKENS
x vocab/TP (0.15 GB each at a 152k vocabulary on one rank, 0.05 GB at SmolLM2's 49k), whatever
the response length. Results do not depend on it (every position is computed alone,
tests/test_memory.py). 1024 held 0.6 GB more at SmolLM2's micro-batches on the TRL bench
(docs/training.md, "Memory on the TRL bench"), for no measurable speed."""


def vocab_parallel_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                        vocab_size: int, tp_group=None, temperature: float = 1.0,
                                        chunk_tokens: int = CHUNK_TOKENS):
    """logits [..., v_local] (this rank's vocab slice), targets [...] (global token ids) ->
    (logprobs [...], entropy [...]) in fp32 of softmax(logits / temperature), differentiable
    w.r.t. logits. The division happens after the fp32 upcast, as in vLLM's sampler: dividing
    bf16 logits would round them a second time."""
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    slice_start = tp_rank * logits.shape[-1]
    real_columns = max(0, min(logits.shape[-1], vocab_size - slice_start))
    shape = targets.shape
    logprobs, entropy = _ChunkedLogprobs.apply(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), slice_start, real_columns,
        temperature, chunk_tokens, tp_group if tp_size > 1 else None)
    return logprobs.view(shape), entropy.view(shape)


class _ChunkedLogprobs(torch.autograd.Function):
    """[n, v_local] logits, [n] targets -> ([n] logprobs, [n] entropy); see the module doc.
    Padding columns (from `real_columns` on) take no part and receive no gradient. Per position
    it keeps the max m, log S (S = sum_v exp(z_v - m)) and E - m, so that the backward
    recomputes softmax(z) = exp(z - m - log S) chunk by chunk."""

    @staticmethod
    def forward(ctx, logits, targets, slice_start, real_columns, temperature, chunk_tokens,
                tp_group):
        count = logits.shape[0]
        stats = torch.empty(3, count, dtype=torch.float32, device=logits.device)
        max_logit, log_sum, expected = stats  # views: m, log S, E - m
        logprobs, entropy = torch.empty_like(max_logit), torch.empty_like(max_logit)
        for begin in range(0, count, chunk_tokens):
            rows = slice(begin, begin + chunk_tokens)
            scaled = _scaled_logits(logits[rows, :real_columns], temperature)
            max_logit[rows] = scaled.max(dim=-1).values if real_columns else float("-inf")
            if tp_group is not None:
                dist.all_reduce(max_logit[rows], op=dist.ReduceOp.MAX, group=tp_group)
            shifted = scaled.sub_(max_logit[rows].unsqueeze(-1))
            exp = shifted.exp()
            in_slice, columns = _local_targets(targets[rows], slice_start, real_columns)
            picked = (shifted.gather(-1, columns.unsqueeze(-1)).squeeze(-1) if real_columns
                      else torch.zeros_like(max_logit[rows]))
            sums = torch.stack([exp.sum(dim=-1), torch.where(in_slice, picked, 0.0),
                                (exp * shifted).sum(dim=-1)])
            del scaled, shifted, exp
            if tp_group is not None:
                dist.all_reduce(sums, group=tp_group)
            sum_exp, picked, weighted = sums
            log_sum[rows] = sum_exp.log()
            expected[rows] = weighted / sum_exp
            logprobs[rows] = picked - log_sum[rows]
            entropy[rows] = log_sum[rows] - expected[rows]
        ctx.save_for_backward(logits, targets, stats)
        ctx.slice_start, ctx.real_columns = slice_start, real_columns
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, targets, (max_logit, log_sum, expected) = ctx.saved_tensors
        real_columns = ctx.real_columns
        grad = torch.zeros_like(logits)
        for begin in range(0, logits.shape[0], ctx.chunk_tokens):
            rows = slice(begin, begin + ctx.chunk_tokens)
            shifted = _scaled_logits(logits[rows, :real_columns], ctx.temperature).sub_(
                max_logit[rows].unsqueeze(-1))
            probs = (shifted - log_sum[rows].unsqueeze(-1)).exp_()
            chunk_grad = probs.mul_(grad_entropy[rows].unsqueeze(-1)
                                    * (expected[rows].unsqueeze(-1) - shifted)
                                    - grad_logprobs[rows].unsqueeze(-1))
            in_slice, columns = _local_targets(targets[rows], ctx.slice_start, real_columns)
            if real_columns:
                chunk_grad.scatter_add_(-1, columns.unsqueeze(-1), torch.where(
                    in_slice, grad_logprobs[rows], 0.0).unsqueeze(-1))
            grad[rows, :real_columns] = chunk_grad / ctx.temperature
        return grad, None, None, None, None, None, None


def _scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 logits / temperature, always a new tensor (shifted in place by the caller)."""
    if temperature != 1.0:
        return logits.float() / temperature
    return logits.to(torch.float32, copy=True)


def _local_targets(targets: torch.Tensor, slice_start: int, real_columns: int):
    """(whether each target is among this rank's real columns, its column, clamped when not)."""
    in_slice = (targets >= slice_start) & (targets < slice_start + real_columns)
    return in_slice, (targets - slice_start).clamp(0, max(real_columns - 1, 0))

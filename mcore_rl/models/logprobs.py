"""Per-token log-probabilities and entropy from vocab-parallel logits, without gathering them.

Each TP rank holds logits for a contiguous slice of the (padded) vocabulary. Only three [b, s]
numbers per rank cross the TP group: the max (no gradient), the sum of exponentials and the
target's logit (both through Megatron's autograd-aware all-reduce, whose backward is the
identity: every TP rank then computes the same loss, so each rank's local slice receives exactly
its share of the gradient). Rows beyond the real vocabulary (padding for TP) are masked to -inf
so results do not depend on the TP size.

    logp(t)  = z_t - logsumexp(z)
    H        = logsumexp(z) - sum_v softmax(z)_v * z_v
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def vocab_parallel_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                        vocab_size: int, tp_group=None, temperature: float = 1.0):
    """logits [..., v_local] (this rank's vocab slice), targets [...] (global token ids) ->
    (logprobs [...], entropy [...]) in fp32 of softmax(logits / temperature), differentiable
    w.r.t. logits. The division happens after the fp32 upcast, as in vLLM's sampler: dividing
    bf16 logits would round them a second time."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    v_local = logits.shape[-1]
    start = tp_rank * v_local
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    vocab_ids = torch.arange(start, start + v_local, device=logits.device)
    is_real = vocab_ids < vocab_size
    if not bool(is_real.all()):
        logits = logits.masked_fill(~is_real, float("-inf"))

    def all_reduce_sum(tensor):
        if tp_size == 1:
            return tensor
        return reduce_from_tensor_model_parallel_region(tensor, group=tp_group)

    with torch.no_grad():
        max_logit = logits.max(dim=-1).values
        if tp_size > 1:
            dist.all_reduce(max_logit, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - max_logit.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = all_reduce_sum(exp.sum(dim=-1))
    log_sum_exp = sum_exp.log()

    in_slice = (targets >= start) & (targets < start + v_local)
    local_targets = (targets - start).clamp(0, v_local - 1)
    target_logit = shifted.gather(-1, local_targets.unsqueeze(-1)).squeeze(-1)
    target_logit = all_reduce_sum(torch.where(in_slice, target_logit, 0.0))
    logprobs = target_logit - log_sum_exp

    finite_shifted = shifted.masked_fill(~is_real, 0.0) if not bool(is_real.all()) else shifted
    expected_logit = all_reduce_sum((exp * finite_shifted).sum(dim=-1)) / sum_exp
    entropy = log_sum_exp - expected_logit
    return logprobs, entropy

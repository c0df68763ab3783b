"""Core attention through PyTorch's `scaled_dot_product_attention` for the local layer spec.

Without Transformer Engine, Megatron's local spec computes attention as two batched matmuls
around a softmax over a materialised [batch x heads, s, s] score tensor. On an H100 with a
0.8B model at sequence 2048 that ran the training step at 123 TFLOP/s in 24.4 GiB; through
SDPA it ran at 146-157 TFLOP/s in 18.2 GiB (docs/gpu.md). PyTorch's fused kernels
(FlashAttention on GPUs, a blocked kernel on CPUs) compute the same function without the score
tensor; GQA heads are shared by the kernel instead of repeated in memory.

Training calls attention without a mask (causal, left-aligned rows padded on the right), as
does the Megatron engine's decode loop (one query over the KV cache), or with packed sequences
(`PackedSequences`: rows back to back in one sequence, Megatron's "thd" format, whose RoPE
restarts at each row): each row attends causally to itself only. Anything else this class
does not implement (an explicit mask, attention dropout in training, a softmax offset,
query-key layer scaling, sliding windows, attention bias) goes to Megatron's own
implementation, which has no context parallelism: under CP those (and packing) are refused.

Under context parallelism (models/context_parallel.py) each rank's queries are two chunks of the
sequence; keys and values are all-gathered within the CP group and each query chunk attends
causally to the keys up to its own end.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from .context_parallel import causal_attention


@dataclass
class PackedSequences(PackedSeqParams):
    """Megatron's packed-sequence parameters ("thd": tokens [t, heads, head_dim], sequences
    back to back as `cu_seqlens` says) with the sequences' lengths as host integers, so that
    SdpaAttention attends within each sequence without reading device tensors. Build with
    `packed_sequences`."""

    segments: tuple[int, ...] = ()
    """The packed sequences' lengths (the final padding is one of them)."""


def packed_sequences(segments: tuple[int, ...], cu_seqlens: torch.Tensor) -> PackedSequences:
    """The parameters of a packed sequence of `segments` (lengths, host integers) whose
    cumulative lengths `cu_seqlens` [segments + 1] int32 live where Megatron's RoPE reads them:
    on the host for its unfused RoPE (which reads them with `.tolist()` in every layer), on
    the GPU for Transformer Engine's fused RoPE and attention."""
    longest = max(segments)
    return PackedSequences(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=longest, max_seqlen_kv=longest,
                           segments=tuple(segments))


class SdpaAttention(DotProductAttention):
    """DotProductAttention whose forward runs one fused SDPA kernel."""

    def __init__(self, config, *args, pg_collection=None, **kwargs):
        # Megatron's class refuses CP (its own forward has none); this one implements it.
        without_cp = copy.copy(config)
        without_cp.context_parallel_size = 1
        super().__init__(without_cp, *args, pg_collection=pg_collection, **kwargs)
        self.config = config
        self.cp_group = None
        """The context-parallel group when CP > 1 (queries are this rank's two chunks)."""
        if config.context_parallel_size > 1:  # Megatron's Attention passes its groups
            self.cp_group = pg_collection.cp

    def _unsupported(self, attention_mask, attention_bias, packed_seq_params) -> bool:
        return (attention_mask is not None or attention_bias is not None
                or (packed_seq_params is not None
                    and not isinstance(packed_seq_params, PackedSequences))
                or self.softmax_offset is not None or self.config.apply_query_key_layer_scaling
                or self.scale_mask_softmax.window_size is not None
                or (self.training and self.attention_dropout.p > 0))

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        unsupported = self._unsupported(attention_mask, attention_bias, packed_seq_params)
        if (unsupported or packed_seq_params is not None) and self.cp_group is not None:
            raise ValueError("SdpaAttention: context parallelism supports causal attention "
                             "without a mask, bias, packed sequences, windows or dropout")
        if unsupported:
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params)
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        query_length, batch = query.shape[:2]
        # Megatron's rule: without a mask, a single query (decoding from a KV cache) sees every
        # key and several queries are causal over as many keys.
        causal = query_length > 1 and self.attn_mask_type == AttnMaskType.causal
        if causal and query_length != key.shape[0]:
            raise ValueError(f"SdpaAttention: a causal call without a mask needs as many "
                             f"queries as keys (got {query_length} and {key.shape[0]})")
        # [s, b, heads, head_dim] -> [b, heads, s, head_dim]
        query, key, value = (tensor.permute(1, 2, 0, 3) for tensor in (query, key, value))
        grouped = self.num_attention_heads_per_partition != self.num_query_groups_per_partition
        if self.cp_group is not None:
            context = causal_attention(query, key, value, self.cp_group, self.softmax_scale,
                                       grouped)
        else:
            context = F.scaled_dot_product_attention(
                query, key, value, is_causal=causal, scale=self.softmax_scale,
                enable_gqa=grouped)
        # [b, heads, s, head_dim] -> [s, b, heads x head_dim]
        return context.permute(2, 0, 1, 3).reshape(query_length, batch,
                                                   self.hidden_size_per_partition)

    def _packed(self, query, key, value, packed: PackedSequences):
        """Causal attention within each packed sequence: query [t, heads, head_dim], key and
        value [t, groups, head_dim] -> [t, heads x head_dim]: one causal SDPA call per
        sequence, whose lengths are host integers (no device read). Each call is the fused
        kernel on the sequence's own square; a block-diagonal mask over [t, t] would make the
        CPU kernel (and the GPU's, which then leaves FlashAttention) compute every score of
        the micro-batch, t / length times the work."""
        if self.attn_mask_type != AttnMaskType.causal:
            raise ValueError("SdpaAttention: packed sequences need causal attention")
        grouped = self.num_attention_heads_per_partition != self.num_query_groups_per_partition
        # [t, heads, head_dim] -> [1, heads, t, head_dim]
        query, key, value = (tensor.permute(1, 0, 2).unsqueeze(0)
                             for tensor in (query, key, value))
        context = torch.cat([
            F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                           enable_gqa=grouped)
            for q, k, v in zip(*(tensor.split(packed.segments, dim=2)
                                 for tensor in (query, key, value)))], dim=2)
        # [1, heads, t, head_dim] -> [t, heads x head_dim]
        return context[0].permute(1, 0, 2).reshape(context.shape[2],
                                                   self.hidden_size_per_partition)

"""Core attention through PyTorch's `scaled_dot_product_attention` for the local layer spec.

Without Transformer Engine, Megatron's local spec computes attention as two batched matmuls
around a softmax over a materialised [batch x heads, s, s] score tensor. On an H100 with a
0.8B model at sequence 2048 that ran the training step at 123 TFLOP/s in 24.4 GiB; through
SDPA it ran at 146-157 TFLOP/s in 18.2 GiB (docs/gpu.md). PyTorch's fused kernels
(FlashAttention on GPUs, a blocked kernel on CPUs) compute the same function without the score
tensor; GQA heads are shared by the kernel instead of repeated in memory.

Training calls attention without a mask (causal, left-aligned rows padded on the right), as
does the Megatron engine's decode loop (one query over the KV cache). Anything else this class
does not implement (an explicit mask, attention dropout in training, a softmax offset,
query-key layer scaling, sliding windows, packed sequences, attention bias) goes to Megatron's
own implementation, which has no context parallelism: under CP those are refused.

Under context parallelism (models/context_parallel.py) each rank's queries are two chunks of the
sequence; keys and values are all-gathered within the CP group and each query chunk attends
causally to the keys up to its own end.
"""

from __future__ import annotations

import copy

import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from .context_parallel import causal_attention


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
                or packed_seq_params is not None
                or self.softmax_offset is not None or self.config.apply_query_key_layer_scaling
                or self.scale_mask_softmax.window_size is not None
                or (self.training and self.attention_dropout.p > 0))

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        unsupported = self._unsupported(attention_mask, attention_bias, packed_seq_params)
        if unsupported and self.cp_group is not None:
            raise ValueError("SdpaAttention: context parallelism supports causal attention "
                             "without a mask, bias, packed sequences, windows or dropout")
        if unsupported:
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params)
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

"""Slow, obvious reference layouts for the resharding tests, written from the engines' published
definitions rather than from mcore_rl.resharding.

* vLLM (vllm/model_executor/layers/linear.py, vocab_parallel_embedding.py): starting from the HF
  tensors, QKVParallelLinear rank r holds [q rows of heads r*nq/t..; k rows of its KV heads; v
  rows of the same heads], a KV head shared by t/nkv ranks when t > nkv;
  MergedColumnParallelLinear holds [gate chunk r; up chunk r]; RowParallelLinear chunks the
  input dimension; the embedding and LM head are zero-padded to a multiple of 64 rows and
  chunked; norms are replicated. Mixture-of-Experts layers (vllm/model_executor/layers/
  fused_moe/routed_experts.py `_load_w13` / `_load_w2`): expert e's slot of ``w13_weight`` is
  [gate chunk r; up chunk r], of ``w2_weight`` its down projection's input chunk r; the router
  (``mlp.gate``) and the shared expert's gate are replicated, the shared expert is a dense MLP.
  With expert parallelism (`enable_expert_parallel`; fused_moe/config.py
  `FusedMoEParallelConfig.make`, linear expert placement) engine rank dp x TP + tp of DP x TP
  holds experts [rank E / EP, (rank + 1) E / EP) whole, in slots numbered from 0.
* Megatron at another TP: `sharding.split_for_tp` at PP=1 (tested against transformers).
* Full: the canonical tensor itself.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from mcore_rl.config import ModelConfig
from mcore_rl.conversion.architectures import ARCHITECTURES
from mcore_rl.param_layout import sharding

LLAMA = ARCHITECTURES["LlamaForCausalLM"]
QWEN2_MOE = ARCHITECTURES["Qwen2MoeForCausalLM"]
_EXPERT = re.compile(r"^(.+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def reference_full_state(model: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator)
            for name, shape in sharding.canonical_param_shapes(model).items()}


def _rows(tensor: torch.Tensor, first: int, count: int) -> torch.Tensor:
    return tensor[first:first + count]


def vllm_reference(full_state: dict, model: ModelConfig, tp: int, rank: int,
                   experts: tuple[int, int] | None = None) -> dict:
    """vLLM parameter name -> the tensor rank ``rank`` of a TP=``tp`` engine holds; experts:
    (EP size, EP rank) with expert parallelism."""
    hf = {}
    architecture = QWEN2_MOE if model.moe.enabled else LLAMA
    for name, tensor in full_state.items():
        hf.update(architecture.from_canonical(name, tensor, model))
    d, nq, nkv = model.kv_channels, model.num_attention_heads, model.kv_heads
    result = {}
    for name, tensor in hf.items():
        expert = _EXPERT.match(name)
        if expert and experts:
            block, index, projection = expert.groups()
            per_rank = model.moe.num_experts // experts[0]
            slot = int(index) - experts[1] * per_rank
            if not 0 <= slot < per_rank or projection == "up":
                continue
            if projection == "gate":
                result[f"{block}.routed_experts.w13_weight[{slot}]"] = torch.cat(
                    [tensor, hf[name.replace("gate_proj", "up_proj")]])
            else:
                result[f"{block}.routed_experts.w2_weight[{slot}]"] = tensor
            continue
        if expert:
            block, index, projection = expert.groups()
            if projection == "gate":
                up = hf[name.replace("gate_proj", "up_proj")]
                result[f"{block}.routed_experts.w13_weight[{index}]"] = torch.cat(
                    [tensor.chunk(tp)[rank], up.chunk(tp)[rank]])
            elif projection == "down":
                result[f"{block}.routed_experts.w2_weight[{index}]"] = tensor.chunk(tp, dim=1)[rank]
            continue
        if ".k_proj." in name or ".v_proj." in name or ".up_proj." in name:
            continue
        if ".q_proj." in name:
            k, v = hf[name.replace("q_proj", "k_proj")], hf[name.replace("q_proj", "v_proj")]
            q_heads = nq // tp
            if tp >= nkv:
                kv_first, kv_count = rank // (tp // nkv), 1
            else:
                kv_first, kv_count = rank * (nkv // tp), nkv // tp
            result[name.replace("q_proj", "qkv_proj")] = torch.cat([
                _rows(tensor, rank * q_heads * d, q_heads * d),
                _rows(k, kv_first * d, kv_count * d), _rows(v, kv_first * d, kv_count * d)])
        elif ".gate_proj." in name:
            up = hf[name.replace("gate_proj", "up_proj")]
            result[name.replace("gate_proj", "gate_up_proj")] = torch.cat(
                [tensor.chunk(tp)[rank], up.chunk(tp)[rank]])
        elif ".o_proj." in name or ".down_proj." in name:
            result[name] = tensor.chunk(tp, dim=1)[rank]
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            padded_rows = -(-model.vocab_size // 64) * 64
            padded = F.pad(tensor, (0, 0, 0, padded_rows - model.vocab_size))
            result[name] = padded.chunk(tp)[rank]
        else:
            result[name] = tensor
    return result


def megatron_reference(full_state: dict, model: ModelConfig, tp: int, rank: int) -> dict:
    return {name: sharding.split_for_tp(name, tensor, model, tp, rank)
            for name, tensor in full_state.items()}


def expected_shards(full_state: dict, model: ModelConfig, engine: str, tp: int,
                    tp_rank: int, experts: tuple[int, int] | None = None) -> dict:
    if engine == "vllm":
        return vllm_reference(full_state, model, tp, tp_rank, experts)
    if engine == "megatron":
        return megatron_reference(full_state, model, tp, tp_rank)
    return dict(full_state)

"""Tests of mcore_rl.param_layout.sharding against slow, obvious references written here (per-head
loops over HF-style q/k/v, hand-written name tables, and the math the shards must reproduce)."""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from mcore_rl.config.model import ModelConfig
from mcore_rl.param_layout import sharding as sh
from mcore_rl.param_layout.sharding import ShardKind

HIDDEN, HEAD_DIM, FFN, VOCAB, DIVISIBLE_BY = 16, 4, 12, 37, 8
HEAD_LAYOUTS = [(4, 1), (4, 2), (4, 4), (8, 1), (8, 2), (8, 4)]  # (query heads, kv heads)
TP_SIZES = [1, 2, 4]


def make_model(nq: int = 4, nkv: int = 2, tied: bool = False, layers: int = 4,
               bias: bool = True, norm: bool = True) -> ModelConfig:
    """A tiny model whose vocab (37) is not a multiple of tp * 8 for any tp."""
    return ModelConfig(num_layers=layers, hidden_size=HIDDEN, ffn_hidden_size=FFN,
                       num_attention_heads=nq, num_kv_heads=nkv, head_dim=HEAD_DIM,
                       vocab_size=VOCAB, make_vocab_size_divisible_by=DIVISIBLE_BY,
                       tie_embeddings=tied, qkv_bias=bias, qk_norm=norm)


def random_full_state(model: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random values (all distinct) for every canonical parameter."""
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen, dtype=torch.float64)
            for name, shape in sh.canonical_param_shapes(model).items()}


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Float64 closeness (torch.testing.assert_close costs ~1.5 s of imports on first use)."""
    assert actual.shape == expected.shape
    assert torch.allclose(actual, expected, rtol=1e-10, atol=1e-10), (actual - expected).abs().max()


# ---------------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------------

def head_rows(t: torch.Tensor, head: int) -> torch.Tensor:
    """Rows of one head in an HF-style per-head projection [heads * d, ...]."""
    return t[head * HEAD_DIM:(head + 1) * HEAD_DIM]


def reference_fused_qkv(q, k, v, nq, nkv):
    """Megatron TP=1 fused QKV built one head at a time: per group, its q heads, then k, then v."""
    rows = []
    for group in range(nkv):
        for head in range(nq):
            if head // (nq // nkv) == group:
                rows.append(head_rows(q, head))
        rows.append(head_rows(k, group))
        rows.append(head_rows(v, group))
    return torch.cat(rows)


def reference_rank_heads(nq, nkv, tp, rank):
    """[(q heads, kv head), ...]: the whole groups TP rank `rank` holds when nkv >= tp."""
    assert nkv % tp == 0
    per_group = nq // nkv
    groups = list(range(nkv))[rank * nkv // tp:(rank + 1) * nkv // tp]
    return [([h for h in range(nq) if h // per_group == g], g) for g in groups]


def reference_row_source(nq, nkv, row):
    """(which of "q"/"k"/"v", head, row within the head) of row `row` of the TP=1 fused QKV."""
    per_group = nq // nkv
    group, within = divmod(row, (per_group + 2) * HEAD_DIM)
    slot, offset = divmod(within, HEAD_DIM)
    if slot < per_group:
        return "q", group * per_group + slot, offset
    return ("k" if slot == per_group else "v"), group, offset


def reference_rank_rows(nq, nkv, tp, rank):
    """[(q/k/v, head, row within the head), ...] for the rows TP rank `rank` holds when nkv < tp:
    Megatron's plain contiguous share of the TP=1 rows, which may cut through a group."""
    rows = (nq + 2 * nkv) * HEAD_DIM
    assert rows % tp == 0
    return [reference_row_source(nq, nkv, row)
            for row in range(rank * rows // tp, (rank + 1) * rows // tp)]


def reference_qkv_shard(q, k, v, nq, nkv, tp, rank):
    """The QKV shard of `rank`, assembled from HF-style q/k/v: whole groups (per group its q heads,
    k, v) when nkv >= tp, otherwise row by row from `reference_rank_rows`."""
    if nkv >= tp:
        rows = []
        for q_heads, kv_head in reference_rank_heads(nq, nkv, tp, rank):
            rows += [head_rows(q, h) for h in q_heads]
            rows += [head_rows(k, kv_head), head_rows(v, kv_head)]
        return torch.cat(rows)
    source = {"q": q, "k": k, "v": v}
    return torch.stack([source[which][head * HEAD_DIM + offset]
                        for which, head, offset in reference_rank_rows(nq, nkv, tp, rank)])


def random_hf_qkv(nq, nkv, trailing=(HIDDEN,), seed=1):
    """HF-style q [nq*d, ...], k and v [nkv*d, ...]."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn((n * HEAD_DIM, *trailing), generator=gen, dtype=torch.float64)
                 for n in (nq, nkv, nkv))


def causal_attention(q, k, v):
    """Causal softmax attention of one head: q, k, v are [seq, d]."""
    seq = q.shape[0]
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    scores = (q @ k.T) / HEAD_DIM ** 0.5
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def reference_gqa(x, q_w, k_w, v_w, q_b, k_b, v_b, nq, nkv):
    """Full causal grouped-query attention, HF style: query head j uses KV head j // (nq/nkv)."""
    seq = x.shape[0]
    q = (x @ q_w.T + q_b).view(seq, nq, HEAD_DIM)
    k = (x @ k_w.T + k_b).view(seq, nkv, HEAD_DIM)
    v = (x @ v_w.T + v_b).view(seq, nkv, HEAD_DIM)
    return torch.cat([causal_attention(q[:, h], k[:, h // (nq // nkv)], v[:, h // (nq // nkv)])
                      for h in range(nq)], dim=-1)


def attention_of_groups(mixed, groups, heads_per_group):
    """Split mixed QKV activations [seq, groups * (heads_per_group + 2) * d] the way Megatron does
    ([seq, groups, ...] then q heads / k / v per group); returns (q [seq, heads, d], k, v
    [seq, groups, d])."""
    seq = mixed.shape[0]
    mixed = mixed.view(seq, groups, (heads_per_group + 2) * HEAD_DIM)
    q, k, v = mixed.split([heads_per_group * HEAD_DIM, HEAD_DIM, HEAD_DIM], dim=-1)
    return q.reshape(seq, groups * heads_per_group, HEAD_DIM), k, v


def megatron_local_attention(mixed, nq, nkv, tp):
    """Attention on one TP rank when nkv >= tp: its own mixed QKV activations (x @ shard.T + bias
    shard) hold nkv/tp whole groups, each with its nq/nkv query heads."""
    per_group = nq // nkv
    q, k, v = attention_of_groups(mixed, nkv // tp, per_group)
    return torch.cat([causal_attention(q[:, h], k[:, h // per_group], v[:, h // per_group])
                      for h in range(nq // tp)], dim=-1)


def megatron_gathered_attention(mixed_by_rank, rank, nq, nkv, tp):
    """Attention on TP rank `rank` when nkv < tp, following Megatron's native path
    (Attention.get_query_key_value_tensors with num_query_groups = nkv < tp): all-gather every
    rank's mixed QKV activations along the last dim, take group rank // (tp/nkv), split it into q
    heads, k and v, then keep the q heads slice rank % (tp/nkv) of size (nq/nkv) / (tp/nkv)."""
    ranks_per_group = tp // nkv
    gathered = torch.cat(mixed_by_rank, dim=-1)
    size = gathered.shape[-1] // nkv
    group = rank // ranks_per_group
    q, k, v = attention_of_groups(gathered[:, group * size:(group + 1) * size], 1, nq // nkv)
    heads = (nq // nkv) // ranks_per_group
    first = (rank % ranks_per_group) * heads
    return torch.cat([causal_attention(q[:, h], k[:, 0], v[:, 0])
                      for h in range(first, first + heads)], dim=-1)


# ---------------------------------------------------------------------------------------------
# Names, kinds, shapes
# ---------------------------------------------------------------------------------------------

def test_canonical_param_shapes_match_megatron_named_parameters():
    # Order and shapes as printed by GPTModel(local spec, RMSNorm, qkv bias, qk layernorm,
    # rope).named_parameters() at TP=1, PP=1 with megatron-core 0.16.1.
    model = make_model(nq=4, nkv=2, layers=2)
    qkv = (4 + 2 * 2) * HEAD_DIM
    expected = [("embedding.word_embeddings.weight", (VOCAB, HIDDEN))]
    for i in range(2):
        p = f"decoder.layers.{i}."
        expected += [
            (p + "input_layernorm.weight", (HIDDEN,)),
            (p + "self_attention.linear_proj.weight", (HIDDEN, 4 * HEAD_DIM)),
            (p + "self_attention.linear_qkv.weight", (qkv, HIDDEN)),
            (p + "self_attention.linear_qkv.bias", (qkv,)),
            (p + "self_attention.q_layernorm.weight", (HEAD_DIM,)),
            (p + "self_attention.k_layernorm.weight", (HEAD_DIM,)),
            (p + "pre_mlp_layernorm.weight", (HIDDEN,)),
            (p + "mlp.linear_fc1.weight", (2 * FFN, HIDDEN)),
            (p + "mlp.linear_fc2.weight", (HIDDEN, FFN)),
        ]
    expected += [("decoder.final_layernorm.weight", (HIDDEN,)),
                 ("output_layer.weight", (VOCAB, HIDDEN))]
    assert list(sh.canonical_param_shapes(model).items()) == expected


def test_canonical_param_shapes_optional_params():
    names = sh.canonical_param_shapes(make_model(tied=True, bias=False, norm=False))
    assert "output_layer.weight" not in names
    assert not any(n.endswith(("linear_qkv.bias", "q_layernorm.weight", "k_layernorm.weight"))
                   for n in names)
    assert len(names) == 1 + 4 * 6 + 1


@pytest.mark.parametrize("name, kind", [
    ("embedding.word_embeddings.weight", ShardKind.VOCAB),
    ("output_layer.weight", ShardKind.VOCAB),
    ("decoder.final_layernorm.weight", ShardKind.REPLICATED),
    ("decoder.layers.7.input_layernorm.weight", ShardKind.REPLICATED),
    ("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", ShardKind.REPLICATED),
    ("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", ShardKind.REPLICATED),
    ("decoder.layers.0.self_attention.q_layernorm.weight", ShardKind.REPLICATED),
    ("decoder.layers.0.self_attention.k_layernorm.weight", ShardKind.REPLICATED),
    ("decoder.layers.0.pre_mlp_layernorm.weight", ShardKind.REPLICATED),
    ("decoder.layers.3.self_attention.linear_qkv.weight", ShardKind.QKV),
    ("decoder.layers.3.self_attention.linear_qkv.bias", ShardKind.QKV),
    ("decoder.layers.3.self_attention.linear_proj.weight", ShardKind.ROW),
    ("decoder.layers.3.mlp.linear_fc1.weight", ShardKind.GATE_UP),
    ("decoder.layers.3.mlp.linear_fc2.weight", ShardKind.ROW),
])
def test_shard_kind(name, kind):
    assert sh.shard_kind(name) is kind


def test_transformer_engine_names_and_extra_state():
    assert (sh.canonical_name("decoder.layers.5.self_attention.linear_qkv.layer_norm_weight")
            == "decoder.layers.5.input_layernorm.weight")
    assert (sh.canonical_name("decoder.layers.2.mlp.linear_fc1.layer_norm_weight")
            == "decoder.layers.2.pre_mlp_layernorm.weight")
    assert sh.canonical_name("decoder.layers.2.mlp.linear_fc1.weight") == \
        "decoder.layers.2.mlp.linear_fc1.weight"
    assert not sh.is_parameter_name("decoder.layers.0.self_attention.linear_qkv._extra_state")
    assert sh.is_parameter_name("decoder.layers.0.self_attention.linear_qkv.weight")


@pytest.mark.parametrize("nq, nkv", HEAD_LAYOUTS)
@pytest.mark.parametrize("tp", TP_SIZES)
def test_local_shapes_match_megatron_partition_sizes(nq, nkv, tp):
    model = make_model(nq, nkv)
    padded = -(-VOCAB // (DIVISIBLE_BY * tp)) * DIVISIBLE_BY * tp
    p = "decoder.layers.0."
    expected = {
        "embedding.word_embeddings.weight": (padded // tp, HIDDEN),
        # ColumnParallelLinear over (nq + 2 * nkv) * d rows, also when nkv < tp.
        p + "self_attention.linear_qkv.weight": ((nq + 2 * nkv) * HEAD_DIM // tp, HIDDEN),
        p + "self_attention.linear_qkv.bias": ((nq + 2 * nkv) * HEAD_DIM // tp,),
        p + "self_attention.linear_proj.weight": (HIDDEN, nq * HEAD_DIM // tp),
        p + "mlp.linear_fc1.weight": (2 * FFN // tp, HIDDEN),
        p + "mlp.linear_fc2.weight": (HIDDEN, FFN // tp),
        p + "input_layernorm.weight": (HIDDEN,),
        p + "self_attention.q_layernorm.weight": (HEAD_DIM,),
    }
    for name, shape in expected.items():
        assert sh.local_shape(name, model, tp) == shape, name


# ---------------------------------------------------------------------------------------------
# Tensor-parallel layouts against references
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("nq, nkv", HEAD_LAYOUTS)
@pytest.mark.parametrize("tp", TP_SIZES)
def test_qkv_shards_hold_the_right_heads(nq, nkv, tp):
    model = make_model(nq, nkv)
    for trailing, name in [((HIDDEN,), "decoder.layers.0.self_attention.linear_qkv.weight"),
                           ((), "decoder.layers.0.self_attention.linear_qkv.bias")]:
        q, k, v = random_hf_qkv(nq, nkv, trailing)
        full = reference_fused_qkv(q, k, v, nq, nkv)
        shards = [sh.split_for_tp(name, full, model, tp, r) for r in range(tp)]
        for rank, shard in enumerate(shards):
            assert shard.is_contiguous()
            assert torch.equal(shard, reference_qkv_shard(q, k, v, nq, nkv, tp, rank)), (name, rank)
        assert torch.equal(sh.merge_from_tp(name, shards, model, tp, check_replicas=True), full)


def test_qkv_rank_contents_explicit():
    # 8 query heads, 4 KV heads, TP 2: rank r holds groups 2r and 2r+1 whole.
    assert reference_rank_heads(8, 4, 2, 1) == [([4, 5], 2), ([6, 7], 3)]

    def heads(rows):  # collapse whole heads: [(q/k/v, head), ...] or None if a head is cut
        if len(rows) % HEAD_DIM or any(rows[i][2] != i % HEAD_DIM for i in range(len(rows))):
            return None
        return [rows[i][:2] for i in range(0, len(rows), HEAD_DIM)]

    # 8 query heads, 2 KV heads, TP 4: each rank holds 3 of the 12 head-rows blocks, so groups
    # [q0 q1 q2 q3 k0 v0 | q4 q5 q6 q7 k1 v1] are cut mid-group and no KV head is held twice.
    assert [heads(reference_rank_rows(8, 2, 4, r)) for r in range(4)] == [
        [("q", 0), ("q", 1), ("q", 2)], [("q", 3), ("k", 0), ("v", 0)],
        [("q", 4), ("q", 5), ("q", 6)], [("q", 7), ("k", 1), ("v", 1)]]
    # 4 query heads, 1 KV head, TP 4: 24 rows [q0 q1 q2 q3 k0 v0], 6 per rank, cutting heads.
    expected = [[("q", 0, i) for i in range(4)] + [("q", 1, 0), ("q", 1, 1)],
                [("q", 1, 2), ("q", 1, 3)] + [("q", 2, i) for i in range(4)],
                [("q", 3, i) for i in range(4)] + [("k", 0, 0), ("k", 0, 1)],
                [("k", 0, 2), ("k", 0, 3)] + [("v", 0, i) for i in range(4)]]
    assert [reference_rank_rows(4, 1, 4, r) for r in range(4)] == expected


@pytest.mark.parametrize("nq, nkv", HEAD_LAYOUTS)
@pytest.mark.parametrize("tp", TP_SIZES)
def test_sharded_attention_matches_full_gqa(nq, nkv, tp):
    """Each rank computes its mixed QKV activations from its QKV weight and bias shards, runs
    Megatron's attention on them (locally when nkv >= tp, after the all-gather of Megatron's
    native path when nkv < tp) and its linear_proj (row) shard; the all-reduce (sum) of the
    partial outputs equals full GQA attention from HF-style q/k/v."""
    model = make_model(nq, nkv)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, HIDDEN, generator=gen, dtype=torch.float64)
    proj = torch.randn(HIDDEN, nq * HEAD_DIM, generator=gen, dtype=torch.float64)
    q, k, v = random_hf_qkv(nq, nkv)
    q_b, k_b, v_b = random_hf_qkv(nq, nkv, trailing=(), seed=2)
    full = reference_fused_qkv(q, k, v, nq, nkv)
    full_bias = reference_fused_qkv(q_b, k_b, v_b, nq, nkv)
    expected = reference_gqa(x, q, k, v, q_b, k_b, v_b, nq, nkv) @ proj.T

    p = "decoder.layers.0.self_attention."
    mixed_by_rank = [x @ sh.split_for_tp(p + "linear_qkv.weight", full, model, tp, r).T
                     + sh.split_for_tp(p + "linear_qkv.bias", full_bias, model, tp, r)
                     for r in range(tp)]
    total = torch.zeros_like(expected)
    for rank in range(tp):
        if nkv >= tp:
            local = megatron_local_attention(mixed_by_rank[rank], nq, nkv, tp)
        else:
            local = megatron_gathered_attention(mixed_by_rank, rank, nq, nkv, tp)
        assert local.shape == (x.shape[0], nq * HEAD_DIM // tp)
        total += local @ sh.split_for_tp(p + "linear_proj.weight", proj, model, tp, rank).T
    assert_close(total, expected)


@pytest.mark.parametrize("tp", TP_SIZES)
def test_gate_up_shards(tp):
    model = make_model()
    gen = torch.Generator().manual_seed(4)
    gate = torch.randn(FFN, HIDDEN, generator=gen, dtype=torch.float64)
    up = torch.randn(FFN, HIDDEN, generator=gen, dtype=torch.float64)
    full = torch.cat([gate, up])
    name = "decoder.layers.1.mlp.linear_fc1.weight"
    chunk = FFN // tp
    shards = [sh.split_for_tp(name, full, model, tp, r) for r in range(tp)]
    for r, shard in enumerate(shards):
        expected = torch.cat([gate[r * chunk:(r + 1) * chunk], up[r * chunk:(r + 1) * chunk]])
        assert shard.is_contiguous() and torch.equal(shard, expected)
    assert torch.equal(sh.merge_from_tp(name, shards, model, tp), full)


@pytest.mark.parametrize("tp", TP_SIZES)
def test_column_parallel_swiglu_matmul(tp):
    """x @ fc1.T split per rank, rearranged into gate/up, equals the full projection; and the
    SwiGLU MLP computed per rank then summed through row-parallel fc2 equals the full MLP."""
    model = make_model()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, HIDDEN, generator=gen, dtype=torch.float64)
    fc1 = torch.randn(2 * FFN, HIDDEN, generator=gen, dtype=torch.float64)
    fc2 = torch.randn(HIDDEN, FFN, generator=gen, dtype=torch.float64)
    fc1_name = "decoder.layers.0.mlp.linear_fc1.weight"
    fc2_name = "decoder.layers.0.mlp.linear_fc2.weight"

    full_out = x @ fc1.T
    per_rank = [x @ sh.split_for_tp(fc1_name, fc1, model, tp, r).T for r in range(tp)]
    gates = torch.cat([out[:, :FFN // tp] for out in per_rank], dim=1)
    ups = torch.cat([out[:, FFN // tp:] for out in per_rank], dim=1)
    assert_close(torch.cat([gates, ups], dim=1), full_out)

    expected = (torch.nn.functional.silu(full_out[:, :FFN]) * full_out[:, FFN:]) @ fc2.T
    total = torch.zeros_like(expected)
    for r, out in enumerate(per_rank):
        gate, up = out.chunk(2, dim=1)
        fc2_shard = sh.split_for_tp(fc2_name, fc2, model, tp, r)
        total += (torch.nn.functional.silu(gate) * up) @ fc2_shard.T
    assert_close(total, expected)


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("name", ["embedding.word_embeddings.weight", "output_layer.weight"])
def test_vocab_shards_are_zero_padded(tp, name):
    model = make_model()
    full = torch.randn(VOCAB, HIDDEN, dtype=torch.float64) + 10.0  # no accidental zeros
    padded_rows = model.padded_vocab_size(tp)
    assert padded_rows % (DIVISIBLE_BY * tp) == 0 and padded_rows > VOCAB
    per_rank = padded_rows // tp
    shards = [sh.split_for_tp(name, full, model, tp, r) for r in range(tp)]
    for r, shard in enumerate(shards):
        assert shard.shape == (per_rank, HIDDEN) and shard.is_contiguous()
        for local_row in range(per_rank):
            row = r * per_rank + local_row
            expected = full[row] if row < VOCAB else torch.zeros(HIDDEN, dtype=full.dtype)
            assert torch.equal(shard[local_row], expected), (r, local_row)
    assert torch.equal(sh.merge_from_tp(name, shards, model, tp), full)


@pytest.mark.parametrize("tp", TP_SIZES)
def test_row_and_replicated(tp):
    model = make_model()
    fc2 = torch.randn(HIDDEN, FFN)
    shards = [sh.split_for_tp("decoder.layers.0.mlp.linear_fc2.weight", fc2, model, tp, r)
              for r in range(tp)]
    width = FFN // tp
    for r, shard in enumerate(shards):
        assert shard.is_contiguous() and torch.equal(shard, fc2[:, r * width:(r + 1) * width])
    norm = torch.randn(HIDDEN)
    name = "decoder.final_layernorm.weight"
    norm_shards = [sh.split_for_tp(name, norm, model, tp, r) for r in range(tp)]
    assert all(torch.equal(s, norm) for s in norm_shards)
    assert torch.equal(sh.merge_from_tp(name, norm_shards, model, tp, check_replicas=True), norm)


@pytest.mark.parametrize("nq, nkv", HEAD_LAYOUTS)
@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("tied", [False, True])
def test_split_merge_round_trip_every_param(nq, nkv, tp, tied):
    model = make_model(nq, nkv, tied=tied)
    for name, full in random_full_state(model).items():
        shards = [sh.split_for_tp(name, full, model, tp, r) for r in range(tp)]
        for shard in shards:
            assert shard.is_contiguous()
            assert tuple(shard.shape) == sh.local_shape(name, model, tp)
        merged = sh.merge_from_tp(name, shards, model, tp, check_replicas=True)
        assert merged.dtype == full.dtype and torch.equal(merged, full), name


def test_moe_layers_names_kinds_and_shards():
    """An MoE model with a dense first layer (Qwen-MoE's mlp_only_layers) and a gated shared
    expert: the MoE layer's MLP names in Megatron's named_parameters order (router, experts by
    index, shared expert with its gate first), their kinds, and every expert tensor split at
    TP2 so that each rank holds its gate and up rows and its down columns."""
    import dataclasses

    from mcore_rl.config.model import MoEConfig

    moe = MoEConfig(num_experts=3, ffn_hidden_size=6, dense_layers=(0,),
                    shared_expert_ffn_hidden_size=8, shared_expert_gate=True)
    model = dataclasses.replace(make_model(layers=2), moe=moe)
    names = sh.canonical_param_shapes(model)
    dense = [n for n in names if n.startswith("decoder.layers.0.mlp.")]
    assert dense == ["decoder.layers.0.mlp.linear_fc1.weight",
                     "decoder.layers.0.mlp.linear_fc2.weight"]
    p = "decoder.layers.1.mlp."
    expected = [(p + "router.weight", (3, HIDDEN), ShardKind.REPLICATED)]
    for e in range(3):
        expected += [(p + f"experts.local_experts.{e}.linear_fc1.weight", (12, HIDDEN),
                      ShardKind.GATE_UP),
                     (p + f"experts.local_experts.{e}.linear_fc2.weight", (HIDDEN, 6),
                      ShardKind.ROW)]
    expected += [(p + "shared_experts.gate_weight", (1, HIDDEN), ShardKind.REPLICATED),
                 (p + "shared_experts.linear_fc1.weight", (16, HIDDEN), ShardKind.GATE_UP),
                 (p + "shared_experts.linear_fc2.weight", (HIDDEN, 8), ShardKind.ROW)]
    assert [(n, names[n], sh.shard_kind(n)) for n in names if n.startswith(p)] == expected
    full = random_full_state(model)[p + "experts.local_experts.2.linear_fc1.weight"]
    gate, up = full[:6], full[6:]
    for rank in range(2):
        shard = sh.split_for_tp(p + "experts.local_experts.2.linear_fc1.weight", full, model, 2,
                                rank)
        assert torch.equal(shard, torch.cat([gate[3 * rank:3 * rank + 3],
                                             up[3 * rank:3 * rank + 3]]))


# ---------------------------------------------------------------------------------------------
# Pipeline layout
# ---------------------------------------------------------------------------------------------

def test_stage_of_layer():
    model = make_model(layers=4)
    assert [sh.stage_of_layer(i, model, 2) for i in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [sh.stage_of_layer(i, model, 4) for i in range(4)] == [(0, 0), (1, 0), (2, 0), (3, 0)]
    assert [sh.stage_of_layer(i, model, 1) for i in range(4)] == [(0, 0), (0, 1), (0, 2), (0, 3)]
    with pytest.raises(ValueError, match="layer 4"):
        sh.stage_of_layer(4, model, 2)
    with pytest.raises(ValueError, match="num_layers=4 must be at least pipeline"):
        sh.stage_of_layer(0, model, 5)


@pytest.mark.parametrize("layers, stages", [(5, 2), (4, 3), (9, 4), (94, 4), (94, 8), (61, 16)])
def test_uneven_stages_are_megatrons(layers, stages):
    """Where the stages do not divide the layers, each stage holds the layers Megatron builds
    there from the TransformerConfig we give it (its own offset and count functions)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from mcore_rl.config import ParallelConfig
    from mcore_rl.models.transformer_config import megatron_transformer_config

    model = make_model(layers=layers)
    config = megatron_transformer_config(
        model, ParallelConfig(pipeline_model_parallel_size=stages))
    megatrons = [(get_transformer_layer_offset(config, pp_rank=stage),
                  get_num_layers_to_build(config, pp_rank=stage)) for stage in range(stages)]
    ours = [(sh.to_global_name("decoder.layers.0.mlp.linear_fc2.weight", stage, model, stages),
             sh.stage_layers(model, stages)[stage]) for stage in range(stages)]
    assert ours == [(f"decoder.layers.{first}.mlp.linear_fc2.weight", count)
                    for first, count in megatrons]
    assert [sh.stage_of_layer(first, model, stages)[0] for first, _ in megatrons] == \
        list(range(stages))
    assert min(count for _, count in megatrons) >= 1


def test_local_and_global_names():
    model = make_model(layers=4)
    qkv = "self_attention.linear_qkv.weight"
    assert sh.to_local_name(f"decoder.layers.3.{qkv}", model, 2) == (1, f"decoder.layers.1.{qkv}")
    assert sh.to_local_name(f"decoder.layers.2.{qkv}", model, 4) == (2, f"decoder.layers.0.{qkv}")
    assert sh.to_global_name(f"decoder.layers.1.{qkv}", 1, model, 2) == f"decoder.layers.3.{qkv}"
    assert sh.to_global_name(f"decoder.layers.0.{qkv}", 3, model, 4) == f"decoder.layers.3.{qkv}"
    te = "self_attention.linear_qkv.layer_norm_weight"
    assert sh.to_local_name(f"decoder.layers.3.{te}", model, 2) == (1, f"decoder.layers.1.{te}")
    assert sh.to_local_name("embedding.word_embeddings.weight", model, 4) == \
        (0, "embedding.word_embeddings.weight")
    assert sh.to_local_name("decoder.final_layernorm.weight", model, 4) == \
        (3, "decoder.final_layernorm.weight")
    assert sh.to_local_name("output_layer.weight", model, 2) == (1, "output_layer.weight")
    with pytest.raises(ValueError, match="local layer 2"):
        sh.to_global_name(f"decoder.layers.2.{qkv}", 0, model, 2)
    with pytest.raises(ValueError, match="embedding.word_embeddings.weight"):
        sh.to_global_name("embedding.word_embeddings.weight", 1, model, 2)


def _layer_names(i, bias=True, norm=True):
    p = f"decoder.layers.{i}."
    names = [p + "input_layernorm.weight", p + "self_attention.linear_proj.weight",
             p + "self_attention.linear_qkv.weight"]
    names += [p + "self_attention.linear_qkv.bias"] if bias else []
    names += [p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight"] \
        if norm else []
    return names + [p + "pre_mlp_layernorm.weight", p + "mlp.linear_fc1.weight",
                    p + "mlp.linear_fc2.weight"]


@pytest.mark.parametrize("tied", [False, True])
def test_stage_params_two_stages(tied):
    model = make_model(layers=4, tied=tied, bias=False, norm=False)
    stage0 = sh.stage_params(model, 2, 0)
    stage1 = sh.stage_params(model, 2, 1)
    expected0 = {"embedding.word_embeddings.weight": "embedding.word_embeddings.weight"}
    for local, glob in [(0, 0), (1, 1)]:
        expected0.update(zip(_layer_names(local, False, False), _layer_names(glob, False, False)))
    expected1 = {}
    for local, glob in [(0, 2), (1, 3)]:
        expected1.update(zip(_layer_names(local, False, False), _layer_names(glob, False, False)))
    expected1["decoder.final_layernorm.weight"] = "decoder.final_layernorm.weight"
    expected1["output_layer.weight"] = ("embedding.word_embeddings.weight" if tied
                                        else "output_layer.weight")
    assert list(stage0.items()) == list(expected0.items())
    assert list(stage1.items()) == list(expected1.items())


def test_stage_params_four_stages_and_single_stage():
    model = make_model(layers=4, tied=True)
    for p in range(4):
        params = sh.stage_params(model, 4, p)
        layer_part = {k: v for k, v in params.items() if k.startswith("decoder.layers.")}
        assert layer_part == dict(zip(_layer_names(0), _layer_names(p)))
        assert ("embedding.word_embeddings.weight" in params) == (p == 0)
        assert ("decoder.final_layernorm.weight" in params) == (p == 3)
        assert params.get("output_layer.weight") == ("embedding.word_embeddings.weight"
                                                     if p == 3 else None)
    single = sh.stage_params(model, 1, 0)
    assert "output_layer.weight" not in single  # tied at PP=1: the embedding is reused directly
    assert list(single.values()) == list(sh.canonical_param_shapes(model))
    assert list(single) == list(sh.canonical_param_shapes(model))


# ---------------------------------------------------------------------------------------------
# Whole state dicts over TP x PP grids
# ---------------------------------------------------------------------------------------------

GRIDS = [(2, 2), (4, 1), (1, 4), (1, 1), (4, 2)]


@pytest.mark.parametrize("tp, pp", GRIDS)
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("nq, nkv", [(8, 2), (4, 1), (4, 4)])
def test_shard_full_state_merge_shards_round_trip(tp, pp, tied, nq, nkv):
    model = make_model(nq, nkv, tied=tied)
    full = random_full_state(model)
    shards = {(t, p): sh.shard_full_state(full, model, tp, pp, t, p)
              for t, p in itertools.product(range(tp), range(pp))}
    for (t, p), local in shards.items():
        assert list(local) == list(sh.stage_params(model, pp, p))
        for name, tensor in local.items():
            assert tensor.is_contiguous()
            assert tuple(tensor.shape) == sh.local_shape(name, model, tp), name
        # The local layers of stage p hold the global layers p*L/P + i.
        per_stage = model.num_layers // pp
        for i in range(per_stage):
            local_fc2 = local[f"decoder.layers.{i}.mlp.linear_fc2.weight"]
            global_fc2 = full[f"decoder.layers.{p * per_stage + i}.mlp.linear_fc2.weight"]
            width = FFN // tp
            assert torch.equal(local_fc2, global_fc2[:, t * width:(t + 1) * width])
    if tied and pp > 1:
        for t in range(tp):
            assert torch.equal(shards[(t, pp - 1)]["output_layer.weight"],
                               shards[(t, 0)]["embedding.word_embeddings.weight"])
    merged = sh.merge_shards(shards, model, tp, pp, check_replicas=True)
    assert list(merged) == list(full)
    for name in full:
        assert torch.equal(merged[name], full[name]), name


def test_merge_shards_accepts_transformer_engine_names():
    model = make_model()
    full = random_full_state(model)
    shards = {}
    for t, p in itertools.product(range(2), range(2)):
        local = sh.shard_full_state(full, model, 2, 2, t, p)
        te_local = {}
        for name, tensor in local.items():
            name = name.replace("input_layernorm.weight",
                                "self_attention.linear_qkv.layer_norm_weight")
            name = name.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
            te_local[name] = tensor
            if name.endswith("linear_qkv.weight"):
                te_local[name.replace(".weight", "._extra_state")] = torch.empty(0)
        shards[(t, p)] = te_local
    merged = sh.merge_shards(shards, model, 2, 2)
    assert all(torch.equal(merged[n], full[n]) for n in full)


# ---------------------------------------------------------------------------------------------
# Errors name what is wrong
# ---------------------------------------------------------------------------------------------

def test_unknown_parameter_is_named():
    with pytest.raises(ValueError, match=re.escape("decoder.layers.0.mlp.bogus.weight")):
        sh.shard_kind("decoder.layers.0.mlp.bogus.weight")
    with pytest.raises(ValueError, match=re.escape("embedding.position_embeddings.weight")):
        sh.split_for_tp("embedding.position_embeddings.weight", torch.zeros(4, 4), make_model(),
                        1, 0)


def test_bad_full_shape_names_tensor_and_shapes():
    model = make_model()
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    message = f"{name!r} has shape (10, 16), expected (32, 16)"
    with pytest.raises(ValueError, match=re.escape(message)):
        sh.split_for_tp(name, torch.zeros(10, 16), model, 2, 0)
    with pytest.raises(ValueError, match=re.escape("'embedding.word_embeddings.weight' has shape "
                                                   "(40, 16), expected (37, 16)")):
        sh.split_for_tp("embedding.word_embeddings.weight", torch.zeros(40, 16), model, 1, 0)


def test_bad_shards_name_tensor_and_shapes():
    model = make_model()
    name = "decoder.layers.0.mlp.linear_fc2.weight"
    with pytest.raises(ValueError, match=re.escape(name) + r".*\(16, 5\).*\(16, 6\)"):
        sh.merge_from_tp(name, [torch.zeros(16, 6), torch.zeros(16, 5)], model, 2)
    with pytest.raises(ValueError, match=re.escape(name) + ".*1 shards"):
        sh.merge_from_tp(name, [torch.zeros(16, 6)], model, 2)


def test_bad_layouts_and_ranks():
    with pytest.raises(ValueError, match="num_kv_heads"):
        sh.split_for_tp("decoder.final_layernorm.weight", torch.zeros(HIDDEN),
                        make_model(nq=12, nkv=4), 3, 0)  # 4 KV heads over 3 ranks
    # 1 KV head over 8 ranks is fine, but (8 + 2 * 1) * 2 = 20 fused QKV rows are not divisible by
    # 8, so Megatron's plain dim-0 chunk of linear_qkv would not be even.
    odd_rows = ModelConfig(num_layers=1, hidden_size=HIDDEN, ffn_hidden_size=HIDDEN,
                           num_attention_heads=8, num_kv_heads=1, head_dim=2, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="QKV rows"):
        sh.split_for_tp("decoder.final_layernorm.weight", torch.zeros(HIDDEN), odd_rows, 8, 0)
    ok_rows = ModelConfig(num_layers=1, hidden_size=HIDDEN, ffn_hidden_size=HIDDEN,
                          num_attention_heads=8, num_kv_heads=1, head_dim=4, vocab_size=VOCAB)
    assert sh.local_shape("decoder.layers.0.self_attention.linear_qkv.weight", ok_rows, 8) == \
        ((8 + 2) * 4 // 8, HIDDEN)
    with pytest.raises(ValueError, match="tp_rank=2"):
        sh.split_for_tp("decoder.final_layernorm.weight", torch.zeros(HIDDEN), make_model(), 2, 2)


def test_state_errors():
    model = make_model()
    full = random_full_state(model)
    missing = dict(full)
    del missing["decoder.layers.3.mlp.linear_fc1.weight"]
    with pytest.raises(ValueError, match=re.escape("decoder.layers.3.mlp.linear_fc1.weight")):
        sh.shard_full_state(missing, model, 1, 2, 0, 1)
    sh.shard_full_state(missing, model, 1, 2, 0, 0)  # stage 0 does not need layer 3
    with pytest.raises(ValueError, match="decoder.layers.9.mlp.linear_fc1.weight"):
        sh.shard_full_state({**full, "decoder.layers.9.mlp.linear_fc1.weight": torch.zeros(1)},
                            model, 1, 1, 0, 0)

    shards = {(t, 0): sh.shard_full_state(full, model, 2, 1, t, 0) for t in range(2)}
    shards[(1, 0)]["decoder.final_layernorm.weight"] = torch.zeros(HIDDEN, dtype=torch.float64)
    with pytest.raises(ValueError, match="decoder.final_layernorm.weight"):
        sh.merge_shards(shards, model, 2, 1, check_replicas=True)
    del shards[(1, 0)]["decoder.layers.0.mlp.linear_fc2.weight"]
    with pytest.raises(ValueError, match=r"tp=1, pp=0.*decoder\.layers\.0\.mlp\.linear_fc2"):
        sh.merge_shards(shards, model, 2, 1)
    with pytest.raises(ValueError, match="grid"):
        sh.merge_shards({(0, 0): shards[(0, 0)]}, model, 2, 1)


@pytest.mark.parametrize("nq, nkv, tp", [(8, 2, 4), (4, 1, 2), (4, 1, 4)])
def test_qkv_merge_with_kv_heads_fewer_than_tp_is_plain_concatenation(nq, nkv, tp):
    # No KV head is held by two ranks, so every row of every shard lands in the merge once and
    # check_replicas has nothing to compare for QKV.
    model = make_model(nq, nkv)
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    full = random_full_state(model)[name]
    shards = [sh.split_for_tp(name, full, model, tp, r) for r in range(tp)]
    assert sum(shard.shape[0] for shard in shards) == full.shape[0]
    shards[1] = shards[1].clone()
    shards[1][-1] += 1.0
    merged = sh.merge_from_tp(name, shards, model, tp, check_replicas=True)
    assert torch.equal(merged, torch.cat(shards))
    changed = (merged != full).any(dim=1).nonzero().flatten().tolist()
    assert changed == [2 * full.shape[0] // tp - 1]

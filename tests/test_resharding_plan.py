"""The resharding plan, checked in-process without communication.

Each plan is executed "by hand" on tensors cut by the trainer's own sharding rules, and every
delivered shard is compared bitwise with slow reference layouts written from vLLM's and
Megatron's definitions (tests/resharding_reference.py). Received bytes are compared with a lower
bound counted by brute force: full tensors filled with distinct values, and for each rank the
number of values of its rollout shard that appear nowhere in its training shard.
"""

import dataclasses
from itertools import permutations

import pytest
import torch

from mcore_rl.config import ModelConfig
from mcore_rl.config.model import MoEConfig
from mcore_rl.param_layout import sharding
from mcore_rl.resharding import PlanError, TrainingLayout, build_plan, make_rollout_layout
from mcore_rl.resharding.full_gather import FullGatherSync, full_gather_transfers
from mcore_rl.resharding.layouts import DEFAULT_ORDER
from mcore_rl.resharding.plan import bucket_load, traffic_of
from mcore_rl.resharding.rank_order import choose_training_order, tp_groups_within_nodes
from resharding_reference import expected_shards, reference_full_state

# 8 heads, 2 KV heads (TP 4 and 8 replicate KV heads in vLLM); vocab 1000 is padded differently
# by Megatron (multiple of 128 x TP) and vLLM (multiple of 64); QKV bias and QK-norm on.
MODEL = ModelConfig(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=8,
                    num_kv_heads=2, vocab_size=1000, max_position_embeddings=64, qkv_bias=True,
                    qk_norm=True)
TIED = dataclasses.replace(MODEL, tie_embeddings=True, qkv_bias=False, qk_norm=False,
                           num_kv_heads=4)

# (training tp, pp, dp) -> (engine, rollout tp): the benchmark pairs plus edge cases.
PAIRS = [
    ((2, 2, 1), ("vllm", 2)), ((2, 2, 1), ("vllm", 4)), ((1, 4, 1), ("vllm", 2)),
    ((4, 2, 1), ("vllm", 2)), ((2, 2, 2), ("vllm", 4)), ((2, 2, 1), ("megatron", 4)),
    ((4, 2, 1), ("megatron", 2)), ((2, 2, 2), ("megatron", 4)), ((1, 1, 4), ("vllm", 4)),
    ((4, 1, 2), ("vllm", 8)), ((2, 2, 1), ("full", 1)), ((2, 4, 1), ("megatron", 8)),
    ((2, 2, 1, ("pp", "tp", "dp")), ("vllm", 4)), ((4, 2, 1, ("pp", "dp", "tp")), ("vllm", 2)),
]
"""Training dims may name a rank order (fastest first) other than Megatron's default."""


def training_shards(full_state, layout: TrainingLayout) -> dict[int, dict[str, torch.Tensor]]:
    """Every rank's local training state, cut by the trainer's sharding rules."""
    shards = {}
    for rank in range(layout.world_size):
        tp_rank, pp_rank, ep_rank, etp_rank = layout.holding(rank)
        shards[rank] = sharding.shard_full_state(full_state, layout.model, layout.tp,
                                                 layout.pp, tp_rank, pp_rank, "lm", layout.ep,
                                                 ep_rank, (layout.grid.expert_tp, etp_rank))
    return shards


def execute_by_hand(plan, local_states) -> dict[int, dict[str, torch.Tensor]]:
    """Apply every transfer of the plan with plain indexing (no communication)."""
    delivered = {}
    for rank in plan.rollout.ranks:
        delivered[rank] = {}
        for param in plan.params:
            spec = plan.rollout.wanted(rank).get(param.source)
            if spec is None:  # an expert this rank's engine does not serve
                continue
            out = torch.zeros(spec.shape(param.full_shape))
            for run in param.transfers + param.local_copies:
                if run.dst != rank:
                    continue
                sender_name = plan.training.held(run.src)[param.source].name
                rows = local_states[run.src][sender_name].narrow(param.dim, run.src_offset,
                                                                 run.length)
                out.narrow(param.dim, run.dst_offset, run.length).copy_(rows)
            delivered[rank][spec.name] = out
    return delivered


def vllm_experts(rollout, rank: int) -> tuple[int, int] | None:
    """(EP size, EP rank) of vLLM's expert parallelism on job rank ``rank`` (None without)."""
    if not rollout.expert_parallel:
        return None
    index = rank - rollout.first_rank
    return rollout.world_size, rollout.dp_rank_of[index] * rollout.tp + rollout.tp_rank_of[index]


def brute_force_lower_bound(model, layout, rollout) -> list[int]:
    """Elements of each rank's rollout shard that its training shard does not contain, found by
    value: every element of the full model gets a distinct value."""
    offset, distinct = 1, {}
    for name, shape in sharding.canonical_param_shapes(model).items():
        count = int(torch.Size(shape).numel())
        distinct[name] = torch.arange(offset, offset + count, dtype=torch.float64).reshape(shape)
        offset += count
    held = training_shards(distinct, layout)
    lacking = []
    for rank in range(layout.world_size):
        have = torch.cat([t.flatten() for t in held[rank].values()])
        want = torch.cat([t.flatten() for t in expected_shards(
            distinct, model, rollout.engine, rollout.tp, rollout.tp_rank_of[rank],
            vllm_experts(rollout, rank)).values()])
        want = want[want != 0]  # padding rows are zero, never sent
        lacking.append(int((~torch.isin(want, have)).sum()))
    return lacking


@pytest.mark.parametrize("model", [MODEL, TIED], ids=["untied", "tied"])
@pytest.mark.parametrize("training_dims,rollout_dims", PAIRS,
                         ids=[f"tp{t}pp{p}dp{d}{''.join('-' + '-'.join(o) for o in order)}-{e}{r}"
                              for (t, p, d, *order), (e, r) in PAIRS])
def test_plan_delivers_reference_shards_and_only_missing_rows(model, training_dims,
                                                              rollout_dims):
    layout = TrainingLayout(model, *training_dims)
    rollout = make_rollout_layout(layout, *rollout_dims)
    plan = build_plan(layout, rollout, torch.float32)
    full = reference_full_state(model)
    delivered = execute_by_hand(plan, training_shards(full, layout))
    for rank, shards in delivered.items():
        expected = expected_shards(full, model, rollout.engine, rollout.tp,
                                   rollout.tp_rank_of[rank])
        assert shards.keys() == expected.keys()
        for name, tensor in shards.items():
            assert torch.equal(tensor, expected[name]), f"rank {rank} {name}"

    received = plan.traffic().received
    lower_bound = brute_force_lower_bound(model, layout, rollout)
    assert [int(b) // 4 for b in received] == lower_bound
    full_gather = traffic_of(full_gather_transfers(layout), layout.world_size, 4).received
    print(f"{training_dims}->{rollout_dims}: received {received.sum()} bytes, full-gather "
          f"{full_gather.sum()}")


def test_vllm_grouping_is_consecutive_and_megatron_grouping_overlaps_training_shards():
    layout = TrainingLayout(MODEL, 2, 2, 1)
    vllm = make_rollout_layout(layout, "vllm", 4)
    assert vllm.group_ranks() == [[0, 1, 2, 3]]
    megatron = make_rollout_layout(layout, "megatron", 4)
    # Rank (tp=1, pp=0) holds the second half of stage 0's rows: it must take rollout TP rank
    # 2 or 3 (rows inside that half), not 1.
    assert megatron.tp_rank_of[1] in (2, 3) and megatron.tp_rank_of[2] in (0, 1)
    vllm_bytes = build_plan(layout, vllm, torch.float32).traffic().received.sum()
    megatron_bytes = build_plan(layout, megatron, torch.float32).traffic().received.sum()
    assert megatron_bytes < 0.8 * vllm_bytes


@pytest.mark.parametrize("training_dims,rollout_tp,beats_default", [
    ((2, 2, 1), 4, True), ((2, 1, 2), 4, True), ((4, 2, 1), 2, False), ((1, 4, 1), 2, False),
    ((2, 1, 2), 2, False)])
def test_chosen_rank_order_minimises_the_busiest_receiver(training_dims, rollout_tp,
                                                          beats_default):
    """Against every order's real plan: the chosen one's busiest rank receives least. Where
    vLLM's consecutive rollout groups cut across the default order's TP groups (TP2 x PP2 or
    TP2 x DP2 -> rollout TP4) the choice beats the default; TP4 x PP2 -> TP2 would need each
    rank's quarter inside its half, which no order of whole dimensions gives."""
    def busiest(order):
        layout = TrainingLayout(MODEL, *training_dims, order)
        plan = build_plan(layout, make_rollout_layout(layout, "vllm", rollout_tp), torch.float32)
        return int(plan.traffic().received.max())

    chosen = choose_training_order(MODEL, *training_dims, rollout_tp, ranks_per_node=8)
    by_order = {order: busiest(order) for order in permutations(DEFAULT_ORDER)}
    assert busiest(chosen) == min(by_order.values())
    if beats_default:
        assert busiest(chosen) < by_order[DEFAULT_ORDER]
    else:
        assert chosen == DEFAULT_ORDER  # nothing to gain: the default stays


def test_rank_order_keeps_training_tp_groups_inside_a_node():
    # Two ranks per node: PP-fastest orders would split TP2 groups over two nodes.
    chosen = choose_training_order(MODEL, 2, 2, 1, 4, ranks_per_node=2)
    assert tp_groups_within_nodes(TrainingLayout(MODEL, 2, 2, 1, chosen), 2)
    assert not tp_groups_within_nodes(TrainingLayout(MODEL, 2, 2, 1, ("pp", "tp", "dp")), 2)


def test_rank_of_inverts_coordinates():
    layout = TrainingLayout(MODEL, 2, 2, 2)
    assert [layout.rank_of(*layout.coordinates(rank)) for rank in range(8)] == list(range(8))
    # Megatron's default order: TP fastest, then DP, then PP
    assert [layout.coordinates(rank) for rank in (1, 2, 4)] == [(1, 0, 0), (0, 0, 1), (0, 1, 0)]
    pp_first = TrainingLayout(MODEL, 2, 2, 2, ("pp", "tp", "dp"))
    assert [pp_first.coordinates(rank) for rank in (1, 2, 4)] == [(0, 1, 0), (1, 0, 0), (0, 0, 1)]
    assert [pp_first.rank_of(*pp_first.coordinates(rank)) for rank in range(8)] == list(range(8))


def test_plan_is_deterministic():
    layout = TrainingLayout(MODEL, 2, 2, 1)
    rollout = make_rollout_layout(layout, "vllm", 4)
    first = build_plan(layout, rollout, torch.float32)
    second = build_plan(layout, rollout, torch.float32)
    assert first.digest() == second.digest()
    assert build_plan(layout, rollout, torch.bfloat16).digest() != first.digest()


@pytest.mark.parametrize("budget", [40_000, 3_000])
def test_buckets_respect_the_budget_and_carry_every_row_once(budget):
    layout = TrainingLayout(MODEL, 2, 2, 1)
    plan = build_plan(layout, make_rollout_layout(layout, "vllm", 4), torch.float32)
    buckets = plan.buckets(budget)
    order = [param.source for bucket in buckets for param, _ in bucket]
    assert list(dict.fromkeys(order)) == [param.source for param in plan.params]
    for bucket in buckets:
        assert bucket_load(bucket, 4, 4).max() <= budget
    for param in plan.params:
        # every (src, dst, canonical row) of the parameter is carried exactly once
        carried = sorted((run.src, run.dst, run.dst_offset + row) for bucket in buckets
                         for entry, runs in bucket if entry.source == param.source
                         for run in runs for row in range(run.length))
        wanted = sorted((run.src, run.dst, run.dst_offset + row) for run in param.transfers
                        for row in range(run.length))
        assert carried == wanted, param.source


@pytest.mark.parametrize("engine,tp,message", [
    ("vllm", 3, "rollout layout: model.num_attention_heads=8 must be divisible by "
                "tensor_model_parallel_size=3"),
    ("megatron", 4, "rollout tensor-parallel size 4 must divide the world size 6"),
    ("sglang", 2, "must be one of"),
])
def test_bad_rollout_layouts_are_refused_before_planning(engine, tp, message):
    with pytest.raises(PlanError, match=message):
        make_rollout_layout(TrainingLayout(MODEL, 2, 1, 3), engine, tp)


# A dense first layer, then 4 experts (top-2) and a gated shared expert per layer.
MOE_MODEL = dataclasses.replace(MODEL, moe=MoEConfig(
    num_experts=4, ffn_hidden_size=32, dense_layers=(0,), shared_expert_ffn_hidden_size=48,
    shared_expert_gate=True))
# (training tp, pp, dp, rank order, ep[, etp]) -> (vLLM rollout tp, vLLM expert parallelism).
# At ETP1 x TP2 the expert grid cuts across the TP groups: ranks of one TP group hold different
# experts. With vLLM's expert parallelism a rank serves 4 / (DP x TP) experts whole.
MOE_PAIRS = [((1, 1, 4, DEFAULT_ORDER, 2), (2, False)), ((2, 1, 2, DEFAULT_ORDER, 2), (4, False)),
             ((1, 2, 4, DEFAULT_ORDER, 4), (2, False)),
             ((2, 2, 2, ("pp", "tp", "dp"), 2), (8, False)),
             ((2, 1, 2, DEFAULT_ORDER, 2, 1), (4, False)),
             ((2, 1, 1, DEFAULT_ORDER, 2, 1), (2, False)),
             ((2, 1, 2, DEFAULT_ORDER, 1), (4, True)), ((1, 2, 2, DEFAULT_ORDER, 2), (2, True)),
             ((2, 1, 1, DEFAULT_ORDER, 1), (2, True))]


@pytest.mark.parametrize("training_dims,rollout_dims", MOE_PAIRS,
                         ids=[f"tp{t}pp{p}dp{d}ep{e}etp{(*etp, t)[0]}-vllm{r}{'ep' * x}"
                              for (t, p, d, _, e, *etp), (r, x) in MOE_PAIRS])
def test_moe_plan_fills_vllm_expert_slots_with_only_missing_rows(training_dims, rollout_dims):
    rollout_tp, expert_parallel = rollout_dims
    layout = TrainingLayout(MOE_MODEL, *training_dims)
    rollout = make_rollout_layout(layout, "vllm", rollout_tp, expert_parallel=expert_parallel)
    plan = build_plan(layout, rollout, torch.float32)
    full = reference_full_state(MOE_MODEL)
    delivered = execute_by_hand(plan, training_shards(full, layout))
    for rank, shards in delivered.items():
        expected = expected_shards(full, MOE_MODEL, "vllm", rollout_tp, rollout.tp_rank_of[rank],
                                   vllm_experts(rollout, rank))
        assert shards.keys() == expected.keys()
        for name, tensor in shards.items():
            assert torch.equal(tensor, expected[name]), f"rank {rank} {name}"
    received = plan.traffic().received
    assert [int(b) // 4 for b in received] == brute_force_lower_bound(MOE_MODEL, layout, rollout)


def test_vllm_vocabulary_rule():
    # vLLM pads 100 rows to 128 = 2 x 64, which TP 3 cannot split; Megatron pads to 384.
    model = ModelConfig(num_layers=2, hidden_size=96, ffn_hidden_size=96, num_attention_heads=6,
                        num_kv_heads=3, vocab_size=100, max_position_embeddings=64)
    layout = TrainingLayout(model, 1, 1, 3)
    with pytest.raises(PlanError, match="vLLM pads vocab_size=100 to 128"):
        make_rollout_layout(layout, "vllm", 3)
    make_rollout_layout(layout, "megatron", 3)


def test_layouts_over_different_worlds_are_refused():
    rollout = make_rollout_layout(TrainingLayout(MODEL, 2, 2, 1), "vllm", 2)
    with pytest.raises(PlanError, match="covers 4 ranks from rank 0 but the training layout "
                                        "covers 8"):
        build_plan(TrainingLayout(MODEL, 2, 2, 2), rollout, torch.float32)


# (training tp, pp, dp) -> (engine, rollout tp, rollout ranks) in split placement.
SPLIT = [((2, 2, 1), ("vllm", 2, 2)), ((2, 1, 2), ("vllm", 1, 2)), ((1, 2, 2), ("vllm", 4, 4)),
         ((2, 1, 2), ("megatron", 2, 4))]


@pytest.mark.parametrize("training_dims,rollout_dims", SPLIT,
                         ids=[f"tp{t}pp{p}dp{d}-{e}{r}x{n}" for (t, p, d), (e, r, n) in SPLIT])
def test_split_plan_delivers_whole_shards_to_the_rollout_ranks_with_spread_sends(
        training_dims, rollout_dims):
    engine, rollout_tp, rollout_ranks = rollout_dims
    layout = TrainingLayout(MODEL, *training_dims)
    rollout = make_rollout_layout(layout, engine, rollout_tp, rollout_ranks=rollout_ranks)
    assert list(rollout.ranks) == list(range(layout.world_size,
                                             layout.world_size + rollout_ranks))
    plan = build_plan(layout, rollout, torch.float32)
    full = reference_full_state(MODEL)
    delivered = execute_by_hand(plan, training_shards(full, layout))
    traffic = plan.traffic()
    for rank in rollout.ranks:
        tp_rank = rollout.tp_rank_of[rank - layout.world_size]
        expected = expected_shards(full, MODEL, engine, rollout_tp, tp_rank)
        assert delivered[rank].keys() == expected.keys()
        for name, tensor in delivered[rank].items():
            assert torch.equal(tensor, expected[name]), f"rank {rank} {name}"
        # Lower bound: a rollout rank holds nothing, so it receives its whole shard (no padding).
        real = sum(int((t != 0).sum()) for t in expected.values())
        assert int(traffic.received[rank]) // 4 == real
    assert not traffic.received[:layout.world_size].any()
    assert not traffic.sent[layout.world_size:].any()
    # Data-parallel replicas hold the same rows: they share the sending within 25%.
    replicas = {}
    for rank in range(layout.world_size):
        replicas.setdefault(layout.coordinates(rank)[:2], []).append(int(traffic.sent[rank]))
    for sent in replicas.values():
        assert max(sent) <= 1.25 * min(sent), sent


def test_split_rollout_ranks_must_fit_the_rollout_tp():
    with pytest.raises(PlanError, match="rollout tensor-parallel size 2 must divide the world "
                                        "size 3"):
        make_rollout_layout(TrainingLayout(MODEL, 2, 1, 1), "vllm", 2, rollout_ranks=3)


# The full gather ends with every rank holding every full tensor, and each message carries rows
# its receiver lacks, so a rank receives exactly the full model less its training shard. Vocab
# 1024 is padded by neither layout at TP 2: with padding, the baseline counts each TP rank
# vocab/TP rows of the all-gather, not its unpadded share.
EP_BASELINE_MODEL = dataclasses.replace(MOE_MODEL, vocab_size=1024)
EP_BASELINE_LAYOUTS = [(1, 1, 4, DEFAULT_ORDER, 2), (2, 2, 2, DEFAULT_ORDER, 2),
                       (1, 2, 4, ("pp", "tp", "dp"), 4), (2, 2, 2, DEFAULT_ORDER, 1),
                       (2, 1, 2, DEFAULT_ORDER, 2, 1)]


@pytest.mark.parametrize("training_dims", EP_BASELINE_LAYOUTS,
                         ids=[f"tp{t}pp{p}dp{d}-{'-'.join(o)}-ep{e}-etp{(*etp, t)[0]}"
                              for t, p, d, o, e, *etp in EP_BASELINE_LAYOUTS])
def test_full_gather_baseline_receives_the_model_less_the_training_shard(training_dims):
    layout = TrainingLayout(EP_BASELINE_MODEL, *training_dims)
    full = reference_full_state(EP_BASELINE_MODEL)
    model_elements = sum(tensor.numel() for tensor in full.values())
    shards = training_shards(full, layout)
    expected = [model_elements - sum(tensor.numel() for tensor in shards[rank].values())
                for rank in range(layout.world_size)]
    received = traffic_of(full_gather_transfers(layout), layout.world_size, 1).received
    assert [int(count) for count in received] == expected


def test_executed_full_gather_refuses_expert_parallelism():
    layout = TrainingLayout(EP_BASELINE_MODEL, 1, 1, 4, DEFAULT_ORDER, 2)
    with pytest.raises(ValueError, match="expert parallelism"):
        FullGatherSync(layout, make_rollout_layout(layout, "vllm", 2))

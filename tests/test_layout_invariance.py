"""The same weights give the same numbers at every layout (fp32, max abs difference <= 1e-5).

For TP1/PP1 (the reference) and, in a world of 4, TP4 (KV heads replicated), TP2 x CP2 with
sequence parallelism and TP2 x PP2 with tied embeddings (worlds of two for TP2, PP2 and DP2
alone, and the untied model's TP2 x PP2, were dropped for suite time); 3 layers, so every PP2
layout has uneven stages (2 and 1 layers: config.parallel.pipeline_stage_layers, which Megatron
builds from its first/last-stage counts): per-token log-probs, entropies and critic values
before training, the global loss and grad norm of one step, and every updated weight after one
Adam step of Megatron DDP + distributed optimizer on the same global batch. A Mixture-of-Experts
model likewise at EP2, PP2 x EP2, TP2 with sequence parallelism, TP2 x DP2 with sequence
parallelism and its experts at EP2 x ETP1, and CP2 x EP2. Its first layer is dense, so that
world shows sequence parallelism for the dense model too: each TP rank normalises its chunk of
the sequence (models/norm.py) and Megatron sums the norms' gradients over the TP ranks.
"""

import dataclasses

import pytest
import torch

from layout_worker import reference_batch, run_layout
from mcore_rl.config import ModelConfig, MoEConfig
from world import run_world

TOLERANCE = 1e-5

# vocab 250 is not a multiple of 128 * TP; KV heads 2 < TP 4 forces replication;
# untied embeddings here, tied in a second model below; Qwen2/3 features switched on.
MODEL = ModelConfig(num_layers=3, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                    num_kv_heads=2, vocab_size=250, max_position_embeddings=64,
                    qkv_bias=True, qk_norm=True)
TIED = dataclasses.replace(MODEL, tie_embeddings=True, qkv_bias=False, qk_norm=False)

_cache = {}


def layout_result(tmp_path_factory, model, tp, pp, world, use_distributed_optimizer=True, ep=1,
                  dispatcher="alltoall", sequence_parallel=False, etp=None, cp=1):
    key = (model, tp, pp, world, use_distributed_optimizer, ep, dispatcher, sequence_parallel,
           etp, cp)
    if key not in _cache:
        path = tmp_path_factory.mktemp("layout") / "result.pt"
        run_world(world, run_layout, model, tp, pp, str(path), use_distributed_optimizer, ep,
                  dispatcher, sequence_parallel, etp, cp)
        _cache[key] = torch.load(path, weights_only=False)
    return _cache[key]


def max_difference(a: dict, b: dict) -> float:
    return max((a[name] - b[name]).abs().max().item() for name in a)


def assert_same(result, reference):
    mask = reference_batch(MODEL)["attention_mask"].bool()
    for head, names in (("lm", ("logprobs", "entropy")), ("scalar", ("values",))):
        for name in names:
            got, want = result[head][name], reference[head][name]
            assert got.shape == want.shape
            print(f"{head} {name}: max difference {(got - want).abs().max().item():.1e}")
            assert (got - want).abs().max().item() <= TOLERANCE, f"{head} {name}"
            assert got[~mask].abs().max() == 0, f"{head} {name} not zero on padding"
        for metric in ("loss", "grad_norm"):
            assert abs(result[head]["metrics"][metric] - reference[head]["metrics"][metric]) \
                <= TOLERANCE * max(1.0, abs(reference[head]["metrics"][metric]))
        assert result[head]["weights"].keys() == reference[head]["weights"].keys()
        weights_difference = max_difference(result[head]["weights"], reference[head]["weights"])
        print(f"{head} updated weights: max difference {weights_difference:.1e}")
        assert weights_difference <= TOLERANCE


def check_training_moved_weights(reference):
    from layout_worker import reference_full_state
    for head in ("lm", "scalar"):
        before = reference_full_state(MODEL, head)
        moved = max_difference(reference[head]["weights"], before)
        assert moved > 100 * TOLERANCE, f"{head}: one step moved weights by only {moved}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    result = layout_result(tmp_path_factory, MODEL, 1, 1, 1)
    check_training_moved_weights(result)
    return result


@pytest.mark.parametrize("tp, cp", [(4, 1), (2, 2)], ids=["TP4", "TP2xCP2-SP"])
def test_world_of_four_matches_reference(tmp_path_factory, reference, tp, cp):
    """TP4: KV heads replicated. TP2 x CP2 with sequence parallelism: each rank holds two of
    four chunks of every sequence (padded from 22 to 24 positions), attends over keys
    all-gathered in the CP group (models/context_parallel.py) with its TP half of the heads, and
    computes its chunks' log-probs and values; the losses' token counts are summed over DP x CP.
    (TP2 x PP2 runs with tied embeddings below; TP2 x DP2 with sequence parallelism in the MoE
    world TP2xEP2xETP1-SP: its first layer is this model's dense layer.)"""
    assert_same(layout_result(tmp_path_factory, MODEL, tp, 1, 4, sequence_parallel=cp > 1,
                              cp=cp), reference)


def test_tied_embeddings_across_pipeline_stages(tmp_path_factory):
    """TP2 x PP2 over uneven stages (2 and 1 layers), the embedding on the first stage and its
    tied copy on the last."""
    from mcore_rl.param_layout.sharding import stage_layers

    assert stage_layers(TIED, 2) == (2, 1)
    reference = layout_result(tmp_path_factory, TIED, 1, 1, 1)
    result = layout_result(tmp_path_factory, TIED, 2, 2, 4)
    assert_same(result, reference)


MOE = dataclasses.replace(MODEL, moe=MoEConfig(
    num_experts=4, ffn_hidden_size=32, dense_layers=(0,), shared_expert_ffn_hidden_size=48,
    shared_expert_gate=True))
"""Qwen-MoE-like: a dense first layer, then 4 experts (top-2, renormalised) beside a gated
shared expert."""


@pytest.mark.parametrize("tp, pp, ep, world, dispatcher, etp, cp",
                         [(1, 1, 2, 2, "alltoall", None, 1), (1, 2, 2, 4, "alltoall", None, 1),
                          (1, 1, 2, 2, "allgather", None, 1), (2, 1, 1, 2, "alltoall", None, 1),
                          (2, 1, 2, 4, "alltoall", 1, 1), (1, 1, 2, 2, "alltoall", None, 2)],
                         ids=["EP2", "PP2EP2", "EP2-allgather", "TP2-SP", "TP2xEP2xETP1-SP",
                              "CP2xEP2"])
def test_experts_split_over_ranks_train_like_one_rank(tmp_path_factory, tp, pp, ep, world,
                                                      dispatcher, etp, cp):
    """One Adam step of the MoE model with its experts split over EP ranks (tokens exchanged
    all-to-all, or all-gathered, expert gradients reduced over the expert data-parallel ranks),
    or over TP ranks (Megatron's MoE layer needs sequence parallelism there: models/norm.py),
    equals the step on one rank. At TP2 x EP2 x ETP1 the expert grid cuts across the TP
    groups: the two ranks of a TP group hold different whole experts (runtime/layout.py). At
    CP2 x EP2 the two ranks hold two sequence chunks each and exchange those tokens."""
    reference = layout_result(tmp_path_factory, MOE, 1, 1, 1)
    result = layout_result(tmp_path_factory, MOE, tp, pp, world, ep=ep, dispatcher=dispatcher,
                           sequence_parallel=tp > 1, etp=etp, cp=cp)
    if etp is not None:  # the experts really are laid out at ETP1: ranks 0, 1 are one TP group
        assert [(tp_rank, ep_rank) for tp_rank, ep_rank, _ in result["expert_grid"][:2]] \
            == [(0, 0), (1, 1)]
        assert {size for _, _, size in result["expert_grid"]} == {etp}
    assert_same(result, reference)


@pytest.mark.parametrize("tp, pp, ep, world, etp, cp",
                         [(1, 1, 1, 1, None, 1), (1, 1, 2, 2, None, 1), (1, 2, 2, 4, None, 1),
                          (2, 1, 1, 2, None, 1), (2, 1, 2, 4, 1, 1), (1, 1, 2, 2, None, 2)],
                         ids=["one-rank", "EP2", "PP2EP2", "TP2-SP", "TP2xEP2xETP1-SP",
                              "CP2xEP2"])
def test_moe_routers_replay_given_routes(tmp_path_factory, tp, pp, ep, world, etp, cp):
    """Routing replay (models/moe_routing.py, Megatron's RouterReplay) in the worlds above:
    replaying the routes the routers took reproduces the log-probs; replaying every route moved
    to the next expert is followed by every router (observed, not assumed), changes the
    log-probs exactly as on one rank, and shows in moe/router_agreement (the routers' own
    choices against the given routes); with every other row route-less, those rows keep their
    routers' choices while the others are replayed (r3 per row); the MoE metrics are the same
    in every layout."""
    one_rank = layout_result(tmp_path_factory, MOE, 1, 1, 1)["routing"]
    routing = layout_result(tmp_path_factory, MOE, tp, pp, world, ep=ep,
                            sequence_parallel=tp > 1, etp=etp, cp=cp)["routing"]
    natural = routing["natural"]["logprobs"]
    assert (routing["replayed"]["logprobs"] - natural).abs().max() <= 1e-6
    moved_change = (routing["moved"]["logprobs"] - natural).abs().max().item()
    print(f"moving every route to the next expert changes log-probs by up to {moved_change:.3f}")
    assert moved_change > 1e-2
    assert (routing["moved"]["logprobs"] - one_rank["moved"]["logprobs"]).abs().max() \
        <= TOLERANCE
    for name in ("replayed", "moved", "partly"):
        assert routing[name]["followed"], name
    # Rows without routes keep their routers' choices (not fillers); the others are replayed.
    unrouted = routing["unrouted_rows"]
    partly = routing["partly"]["logprobs"]
    assert unrouted.any() and not unrouted.all()
    assert (partly[unrouted] - natural[unrouted]).abs().max() <= 1e-6
    assert (partly[~unrouted] - routing["moved"]["logprobs"][~unrouted]).abs().max() <= 1e-6
    assert 0 < routing["partly"]["metrics"]["moe/routes_replayed"] < 1
    # Agreement: the routers' own choices against the given routes, not the replayed ones.
    assert routing["replayed"]["metrics"]["moe/router_agreement"] == 1.0
    assert 0 < routing["moved"]["metrics"]["moe/router_agreement"] < 0.9
    # The share of fed tokens' routes that were given: none without routes, all with them.
    assert routing["natural"]["metrics"]["moe/routes_replayed"] == 0.0
    assert routing["replayed"]["metrics"]["moe/routes_replayed"] == 1.0
    for name, value in one_rank["natural"]["metrics"].items():
        assert abs(routing["natural"]["metrics"][name] - value) <= 1e-6, name

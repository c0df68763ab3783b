"""Generation with Megatron-Core's inference stack on a Megatron model stage.

Megatron-Core supplies the model-side machinery: `GPTInferenceWrapper` runs the forward pass
(tensor-parallel logits gathered, pipeline stages chained by point-to-point sends) against a
`StaticInferenceContext` KV cache. The decode loop and the sampler are ours, because Megatron's
`TextGenerationController` cannot give the numbers RL needs: it samples over the padded
vocabulary, reports untempered log-probs, shifts the top-p mask, and cannot combine top-k with
top-p (see `sampler`). The loop is the controller's static-batch scheme: prefill up to the
shortest prompt, then one position per step, feeding prompt tokens to rows that are still in
their prompt and sampled tokens to the others.

The engine can generate on the training model itself (no copy, no weight update: the layouts
match by construction) or on a model of its own, refreshed by `update_weights` with Megatron-named
shards straight from the resharder's ``megatron`` layout. Every rank of the model-parallel group
samples the same tokens: logits are identical after the TP gather and the PP broadcast, and the
sampling generator is seeded identically across the group.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from mcore_rl.config.model import ModelConfig
from mcore_rl.config.rollout import PromptConfig, SamplingConfig
from mcore_rl.models.weights import local_parameters, model_rank_of
from mcore_rl.runtime.progress import progress

from .engine import Completion, EngineError, Generation, RolloutEngine
from .prompt_pool import pool_requests
from .token_sampling import sample_next


class MegatronEngine(RolloutEngine):
    """Rollouts from a Megatron GPTModel stage, over the process groups of the layout it was
    built in (the place it carries)."""

    def __init__(self, module: torch.nn.Module, model: ModelConfig, context_length: int,
                 stop_token_ids: Sequence[int] = (), own_weights: bool = False,
                 max_batch_size: int = 64, seed: int = 0):
        """module: this rank's GPTModel stage (LM head), e.g. the actor's own. context_length:
        longest prompt + response. stop_token_ids: always end a response (the tokenizer's EOS).
        own_weights: the module is the engine's copy, so `update_weights` loads into it and
        `sleep` may move it off the GPU; False means it is the trainer's module."""
        from megatron.core.utils import get_model_config

        if get_model_config(module).sequence_parallel:
            raise EngineError("the Megatron engine needs a model built with sequence_parallel="
                              "False (Megatron-Core's static inference does not support it for "
                              "dense models); give the engine its own copy (own_weights=True)")
        self.module = module
        self.model = model
        self.context_length = context_length
        self.stop_token_ids = tuple(stop_token_ids)
        self.max_batch_size = max_batch_size
        self.seed = seed
        self.weight_layout = "megatron" if own_weights else None
        self.device = next(module.parameters()).device
        self.params_dtype = next(module.parameters()).dtype
        here = model_rank_of(module)
        self._group = self.instance_group = here.group("mp")
        self.shard_key = here.dp_rank
        self._pp_group = here.group("pp")
        self._pp_last_rank = here.last_stage_rank
        self._padded_vocab = model.padded_vocab_size(here.tp_size)
        self._dp_rank = here.dp_rank
        self._calls = 0
        self._sleeping = False
        self._weights_mapped = True

    # -- generate --------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig,
                 prompt_config: PromptConfig = PromptConfig(),
                 first_position: int = 0) -> Generation:
        if self._sleeping:
            raise EngineError("generate() called on a sleeping engine; call wake() first")
        started = time.perf_counter()
        requests = pool_requests(prompts, sampling, prompt_config, self.context_length,
                                 self.model.vocab_size, self._dp_rank, self._group,
                                 first_position=first_position)
        # The model-parallel group shares one data shard, hence one sampling config. Prompts
        # are drawn for in one stream: a part of a shard (first_position > 0) gets its own.
        generator = torch.Generator(device=self.device)
        generator.manual_seed((_call_seed(sampling.seed, self.seed, self._dp_rank, self._calls)
                               + first_position * 104_729) % 2 ** 63)
        self._calls += 1
        rows = [(index, sample) for index in range(len(requests.prompts))
                for sample in range(sampling.n)]
        completions = []
        with progress(total=len(rows), desc="generate", unit="resp", leave=False) as bar, \
                _megatron_inference_mode():
            for start in range(0, len(rows), self.max_batch_size):
                chunk = rows[start:start + self.max_batch_size]
                completions += self._generate_batch([requests.prompts[i] for i, _ in chunk],
                                                    chunk, sampling, generator, bar)
        mine = requests.mine
        own = [Completion(c.prompt_index - mine.start, c.sample_index, c.token_ids, c.logprobs,
                          c.finish_reason, prompt_tokens=len(requests.prompts[c.prompt_index]))
               for c in completions if mine.start <= c.prompt_index < mine.stop]
        return Generation.finished(own, requests.prompts[mine], requests.truncated, started)

    @torch.inference_mode()
    def _generate_batch(self, prompts: list[list[int]], rows: list[tuple[int, int]],
                        sampling: SamplingConfig, generator: torch.Generator,
                        bar) -> list[Completion]:
        """bar: advanced by the responses that finish (counted with the loop's existing
        device-to-host sync, so the bar costs no extra one)."""
        wrapper = self._inference_wrapper(len(prompts), max(map(len, prompts))
                                          + sampling.max_new_tokens)
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        total = int(lengths.max()) + sampling.max_new_tokens
        tokens = torch.zeros((len(prompts), total), dtype=torch.long, device=self.device)
        for row, prompt in enumerate(prompts):
            tokens[row, :len(prompt)] = torch.tensor(prompt, device=self.device)
        inputs = wrapper.prep_inference_input(tokens)
        stop_ids = torch.tensor(sorted(set(self.stop_token_ids) | set(sampling.stop_token_ids)),
                                dtype=torch.long, device=self.device)
        logprobs = torch.zeros(tokens.shape, dtype=torch.float32, device=self.device)
        generated = torch.zeros(len(prompts), dtype=torch.long, device=self.device)
        stopped = torch.zeros(len(prompts), dtype=torch.bool, device=self.device)
        start, end, finished = 0, int(lengths.min()), 0
        while True:
            window = wrapper.get_batch_for_context_window(inputs, start, end)
            last_logits = self._last_token_logits(wrapper, window, len(prompts))
            next_tokens, next_logprobs = sample_next(last_logits, sampling, generator)
            active = (lengths <= end) & ~stopped & (generated < sampling.max_new_tokens)
            tokens[active, end] = next_tokens[active]
            logprobs[active, end] = next_logprobs[active]
            generated += active.long()
            stopped |= active & torch.isin(next_tokens, stop_ids)
            done = int((stopped | (generated >= sampling.max_new_tokens)).sum())
            bar.update(done - finished)
            finished = done
            if done == len(prompts):
                break
            if bool((lengths <= end).all()):
                wrapper.inference_context.enable_decode_mode()
            start, end = end, end + 1
        return [Completion(index, sample,
                           tokens[row, lengths[row]:lengths[row] + generated[row]].tolist(),
                           logprobs[row, lengths[row]:lengths[row] + generated[row]].tolist(),
                           "stop" if stopped[row] else "length")
                for row, (index, sample) in enumerate(rows)]

    def _inference_wrapper(self, batch_size: int, sequence_length: int):
        """Megatron-Core's GPT inference wrapper over a static KV cache that keeps only the last
        position's logits. Up to Megatron-Core 0.16 the wrapper also takes an
        InferenceWrapperConfig (sizes, and -1: never split the batch into pipeline
        micro-batches); from 0.17 on the module is gone, the wrapper reads the model's config
        and does not split, and the context's InferenceConfig keeps only the last logits."""
        from megatron.core.inference.contexts import StaticInferenceContext
        from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
            GPTInferenceWrapper)

        context = StaticInferenceContext(batch_size, sequence_length)
        try:
            from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import (
                InferenceWrapperConfig)
        except ImportError:
            wrapper = GPTInferenceWrapper(self.module, context)
        else:
            config = InferenceWrapperConfig(
                hidden_size=self.model.hidden_size, params_dtype=self.params_dtype,
                inference_batch_times_seqlen_threshold=-1,
                padded_vocab_size=self.model.padded_vocab_size(1),  # unused: logits gathered
                inference_max_requests=batch_size, inference_max_seq_length=sequence_length)
            context.materialize_only_last_token_logits = True
            wrapper = GPTInferenceWrapper(self.module, config, context)
        wrapper.prep_model_for_inference()
        return wrapper

    def _last_token_logits(self, wrapper, window: dict, batch_size: int) -> torch.Tensor:
        """[batch, real vocab] fp32 logits of each row's last position, on every rank (the
        vocabulary's padding rows are dropped, so they can never be sampled)."""
        logits = wrapper.run_one_forward_step(window)
        if dist.get_world_size(self._pp_group) > 1:
            if logits is None:
                logits = torch.empty((batch_size, 1, self._padded_vocab), dtype=self.params_dtype,
                                     device=self.device)
            logits = logits.contiguous()
            dist.broadcast(logits, src=self._pp_last_rank, group=self._pp_group)
        return logits[:, -1, :self.model.vocab_size].float()

    # -- weights and memory -----------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.weight_layout is None:
            raise EngineError("this engine generates on the trainer's own module; its weights "
                              "are always current and update_weights must not be called")
        if not self._weights_mapped:
            raise EngineError("update_weights() on a sleeping engine: call wake_weights() first")
        params = local_parameters(self.module)
        seen = set()
        for name, tensor in named_tensors:
            param = params.get(name)
            if param is None or param.shape != tensor.shape:
                expected = None if param is None else tuple(param.shape)
                raise EngineError(f"update_weights: tensor {name!r} {tuple(tensor.shape)} does "
                                  f"not match the engine's parameter (shape {expected})")
            param.copy_(tensor)
            seen.add(name)
        missing = sorted(set(params) - seen)
        if missing:
            raise EngineError(f"update_weights: no tensor arrived for parameters {missing}")

    def sleep(self) -> None:
        """The KV cache lives only inside generate(); an engine-owned copy of the weights moves
        to host memory."""
        if self.weight_layout is not None:
            if self.device.type != "cpu":
                self.module.to("cpu")
            self._weights_mapped = False
        self._sleeping = True

    def wake_weights(self) -> None:
        if not self._weights_mapped and self.device.type != "cpu":
            self.module.to(self.device)
        self._weights_mapped = True

    def wake(self) -> None:
        self.wake_weights()
        self._sleeping = False


def _call_seed(request_seed: int | None, engine_seed: int, dp_rank: int, call: int) -> int:
    """Distinct per data-parallel rank, identical within a model-parallel group; distinct per
    call unless the request names its seed (then the same request samples the same, which is
    what lets a resumed run repeat an uninterrupted one)."""
    if request_seed is not None:
        return (request_seed * 1_000_003 + dp_rank * 7919) % (2 ** 63)
    return (engine_seed * 1_000_003 + dp_rank * 7919 + call) % (2 ** 63)


def _megatron_inference_mode():
    """From Megatron-Core 0.17 on, a model runs as in inference (a static KV cache's last
    position's logits only: what `_last_token_logits` gathers over the pipeline) only while the
    process-wide InferenceMode flag is set, as Megatron's own engines set it; 0.16 reads the
    inference context alone and has no flag."""
    try:
        from megatron.core.inference.utils import InferenceMode
    except ImportError:
        return contextlib.nullcontext()
    return InferenceMode.active()

"""Rollout: the generation side of the RL step (engines, sampling, prompt checks, mismatch).

`vllm_engine` is imported on demand only (`from mcore_rl.rollout.vllm_engine import VllmEngine`):
it and the modules it is split into (vllm_start, vllm_weights, vllm_routes) are the ones that
import vllm, which is optional on training-only machines.
"""

from .engine import (Completion, EngineError, FinishedSample, Generation, RolloutEngine,
                     SampleRequest, prefill_counts)
from .megatron_engine import MegatronEngine
from .mismatch import logprob_mismatch
from .prompts import PreparedPrompts, PromptError, check_request, prepare_prompts

__all__ = ["Completion", "EngineError", "FinishedSample", "Generation", "MegatronEngine",
           "PreparedPrompts", "PromptError", "RolloutEngine", "SampleRequest", "check_request",
           "logprob_mismatch", "prefill_counts", "prepare_prompts"]

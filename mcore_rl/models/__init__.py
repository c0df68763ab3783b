"""Megatron-Core GPT models for the Llama family, scalar heads, and vocab-parallel log-probs."""

from .build import build_gpt_model
from .logprobs import vocab_parallel_logprobs_and_entropy
from .transformer_config import DTYPES, megatron_transformer_config
from .weights import load_full_state, local_state

__all__ = ["DTYPES", "build_gpt_model", "load_full_state", "local_state",
           "megatron_transformer_config", "vocab_parallel_logprobs_and_entropy"]

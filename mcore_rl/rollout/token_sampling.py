"""Choosing the next token from logits, with vLLM's meaning of every sampling parameter.

Both engines must sample the same distribution and report the same log-probs, or switching engine
would silently change an RL run. vLLM's sampler (v1, `logprobs_mode="processed_logprobs"`) is the
reference: temperature divides the logits; top-k keeps the k largest logits; top-p keeps the
smallest set of most likely tokens whose probability reaches p (ties and the last token kept, as
vLLM's `apply_top_k_top_p` does). The reported log-prob is the sampled token's under the whole
tempered distribution, before top-k/top-p (what the trainer scores, so an importance weight
against it corrects for the engine alone, not for the truncation: vLLM's raw log-probs at
temperature 1). Greedy (temperature 0) takes the argmax and reports the model's log-prob of it. Megatron-Core's own TextGenerationController differs on each point (it cannot
combine top-k and top-p, shifts the top-p mask, reports untempered log-probs, and can sample the
vocabulary's padding rows), which is why the Megatron engine uses this sampler instead.
"""

from __future__ import annotations

import torch

from mcore_rl.config.rollout import SamplingConfig


def truncate_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [b, v] with every token outside top-k / top-p set to -inf (vLLM's rule)."""
    if top_k == -1 and top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k != -1 and top_k < vocab:
        kth_largest = sorted_logits[:, vocab - top_k].unsqueeze(-1)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))
    if top_p < 1.0:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        outside = cumulative <= 1 - top_p
        outside[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return sorted_logits.scatter(-1, order, sorted_logits)


def sample_next(logits: torch.Tensor, sampling: SamplingConfig,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [b, v] (real vocabulary only, fp32) -> (token ids [b], their log-probs [b]).

    Random draws use `generator` only, so ranks holding the same logits and the same generator
    state pick the same tokens."""
    logits = logits.float()
    if sampling.temperature == 0:
        tokens = logits.argmax(dim=-1)
        logprobs = logits.log_softmax(dim=-1)
    else:
        tempered = logits / sampling.temperature
        kept = truncate_logits(tempered, sampling.top_k, sampling.top_p).softmax(dim=-1)
        tokens = torch.multinomial(kept, 1, generator=generator).squeeze(-1)
        logprobs = tempered.log_softmax(dim=-1)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

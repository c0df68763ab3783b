"""How rollouts are sampled and what happens to prompts the engine cannot take.

The same fields drive every engine (vLLM, Megatron-Core inference), so a run's sampling does not
change when the engine does. Values are checked before any generation starts.
"""

from __future__ import annotations

from dataclasses import dataclass

OVERLONG_PROMPTS = ("error", "left", "right")


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling parameters of one generate call (vLLM's meanings)."""

    n: int = 1
    """Samples per prompt (a GRPO group)."""

    temperature: float = 1.0
    """Softmax temperature; 0 is greedy."""

    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens with this much probability, in (0, 1]."""

    top_k: int = -1
    """Keep the k most likely tokens; -1 keeps all."""

    max_new_tokens: int = 256
    """Longest response, in tokens."""

    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a response (the tokenizer's EOS is always one)."""

    stop: tuple[str, ...] = ()
    """Strings that end a response."""

    seed: int | None = None
    """Seed of the sampling RNG: a call with a given seed samples the same every time; None
    draws afresh on every call from the engine's seed."""

    def errors(self) -> list[str]:
        """Broken rules, each naming its field (empty when valid)."""
        errors = []
        if self.n < 1:
            errors.append(f"sampling.n={self.n} must be at least 1")
        if self.temperature == 0 and self.n > 1:
            errors.append(f"sampling.n={self.n} with temperature=0 (greedy) would repeat one "
                          "response; use n=1 or a positive temperature")
        if self.temperature < 0:
            errors.append(f"sampling.temperature={self.temperature} must be >= 0 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            errors.append(f"sampling.top_p={self.top_p} must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            errors.append(f"sampling.top_k={self.top_k} must be -1 (all tokens) or positive")
        if self.max_new_tokens < 1:
            errors.append(f"sampling.max_new_tokens={self.max_new_tokens} must be at least 1")
        if any(token < 0 for token in self.stop_token_ids):
            errors.append(f"sampling.stop_token_ids={list(self.stop_token_ids)} must be "
                          "non-negative token ids")
        if any(not text for text in self.stop):
            errors.append("sampling.stop must not contain empty strings")
        return errors


@dataclass(frozen=True)
class PromptConfig:
    """Limits on prompts handed to the engine."""

    max_prompt_tokens: int = 1024
    """Longest prompt the engine accepts (its context minus max_new_tokens at most)."""

    overlong: str = "error"
    """What to do with a longer prompt: "error" (refuse the batch, naming the prompt's index and
    length), "left" (drop its first tokens) or "right" (drop its last tokens). Truncations are
    counted in the rollout metrics."""

    def errors(self) -> list[str]:
        """Broken rules, each naming its field (empty when valid)."""
        errors = []
        if self.max_prompt_tokens < 1:
            errors.append(f"prompts.max_prompt_tokens={self.max_prompt_tokens} must be positive")
        if self.overlong not in OVERLONG_PROMPTS:
            errors.append(f"prompts.overlong={self.overlong!r} must be one of {OVERLONG_PROMPTS}")
        return errors

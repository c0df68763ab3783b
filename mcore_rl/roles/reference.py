"""The reference: the frozen starting policy the KL terms measure the actor against.

With adapters (LoRA) the starting policy is the actor's own frozen base: the reference runs the
actor's module with its adapters off, so no second copy of the model exists.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from mcore_rl.config.model import ModelConfig
from mcore_rl.models.lora import adapters_disabled, has_adapters
from mcore_rl.training import compute_outputs

from .actor import replaying_routes, scoring_inputs


class Reference:
    """A frozen Megatron policy (no optimizer, no DDP); optionally parked in CPU memory."""

    batch_key = "ref_logprobs"
    """Where its scores of a batch go (`score`)."""

    def __init__(self, module: torch.nn.Module, vocab_size: int, micro_batch_size: int,
                 temperature: float, offload: bool, max_tokens: int = 0,
                 model: ModelConfig | None = None, routing_replay: str = "none"):
        """module: this rank's GPTModel stage holding the starting weights, or the actor's own
        stage when it has adapters (they are switched off for the reference's passes, and the
        module is neither frozen nor parked here); max_tokens > 0: token-budget micro-batches;
        model and routing_replay: as the actor's (a Mixture-of-Experts reference replays the
        batch's routes too)."""
        self.adapters_off = has_adapters(module)
        if not self.adapters_off:
            for param in module.parameters():
                param.requires_grad_(False)
        self.module = module
        self.vocab_size = vocab_size
        self.micro_batch_size = micro_batch_size
        self.max_tokens = max_tokens
        self.temperature = temperature if temperature > 0 else 1.0
        self.moe_model = model if model is not None and model.moe.enabled else None
        self.routing_replay = routing_replay
        self.device = next(module.parameters()).device
        self.offload = offload and self.device.type != "cpu" and not self.adapters_off
        if self.offload:
            module.to("cpu")

    def score(self, batch: dict) -> torch.Tensor:
        """The batch's `batch_key`: its log-probs."""
        return self.logprobs(batch)

    def logprobs(self, batch: dict, micro_batch_size: int | None = None) -> torch.Tensor:
        """[n, s] log-probs of the batch's tokens under the reference policy (in micro-batches
        of `micro_batch_size` rows when given, else the role's)."""
        if self.offload:
            self.module.to(self.device)
        inputs = scoring_inputs(batch)
        routing = replaying_routes(self.moe_model, self.routing_replay, batch, inputs)
        with adapters_disabled(self.module) if self.adapters_off else nullcontext():
            logprobs = compute_outputs([self.module], inputs,
                                       micro_batch_size or self.micro_batch_size, "lm",
                                       self.vocab_size, self.temperature,
                                       self.max_tokens, routing)["logprobs"]
        if self.offload:
            self.module.to("cpu")
        return logprobs

"""Low-rank adapters (LoRA) on the trained model's linear layers.

With `enabled`, the model's targeted linears get W x + (alpha / rank) B A dropout(x) with A
[rank, in] and B [out, rank] trained and W frozen (Hu et al. 2021, as HF peft computes it).
The optimizer then holds adapter state only, a checkpoint holds the adapters, and a KL term's
reference is the same model with the adapters off (docs/lora.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .model import ModelConfig

MEGATRON_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""The linear layers of a Llama-family block that take adapters, by their Megatron names."""

HF_TARGETS = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv",
              "o_proj": "linear_proj", "gate_proj": "linear_fc1", "up_proj": "linear_fc1",
              "down_proj": "linear_fc2"}
"""HF (peft) module names and the Megatron linear that holds them. Megatron fuses q, k and v
into one linear (and gate and up into another), so naming one of them adapts the whole fused
linear."""

ALL_LINEAR = "all-linear"
"""peft's name for every linear layer except the output head."""

MLP_TARGETS = ("linear_fc1", "linear_fc2")
"""The MLP's linears. In a Mixture-of-Experts layer they exist only in its shared expert: the
routed experts take no adapters (models/lora.py, `with_adapters`)."""


@dataclass(frozen=True)
class LoraConfig:
    """Adapters of one trained model (actor.lora, sft.lora, dpo.lora, rm.lora)."""

    enabled: bool = False
    """Train low-rank adapters on a frozen base instead of every weight."""

    rank: int = 8
    """r: the inner width of each adapter (A is [r, in], B is [out, r])."""

    alpha: float = 16.0
    """The adapter's output is scaled by alpha / rank (peft's lora_alpha)."""

    dropout: float = 0.0
    """Dropout on the adapter's input while training (peft's lora_dropout); not yet with
    parallel.tensor_model_parallel_size > 1."""

    target_modules: tuple[str, ...] = MEGATRON_TARGETS
    """Linears that get adapters: Megatron names (linear_qkv, linear_proj, linear_fc1,
    linear_fc2), HF names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj: a
    fused Megatron linear is adapted whole), or all-linear."""

    @property
    def scaling(self) -> float:
        """alpha / rank, the factor on B A."""
        return self.alpha / self.rank

    def megatron_targets(self) -> tuple[str, ...]:
        """The targeted Megatron linears, in block order (names must be valid: see errors)."""
        wanted = set()
        for name in self.target_modules:
            wanted.update(MEGATRON_TARGETS if name == ALL_LINEAR else
                          (HF_TARGETS.get(name, name),))
        return tuple(name for name in MEGATRON_TARGETS if name in wanted)

    def errors(self, prefix: str) -> list[str]:
        """Broken rules, each naming its field under `prefix` (empty when valid or off)."""
        if not self.enabled:
            return []
        errors = []
        if self.rank <= 0:
            errors.append(f"{prefix}.rank={self.rank} must be > 0")
        if self.alpha <= 0:
            errors.append(f"{prefix}.alpha={self.alpha} must be > 0")
        if not 0 <= self.dropout < 1:
            errors.append(f"{prefix}.dropout={self.dropout} must be in [0, 1)")
        known = {*MEGATRON_TARGETS, *HF_TARGETS, ALL_LINEAR}
        unknown = [name for name in self.target_modules if name not in known]
        if unknown:
            errors.append(f"{prefix}.target_modules: {unknown} are not linears of a "
                          f"Llama-family block (Megatron: {', '.join(MEGATRON_TARGETS)}; HF: "
                          f"{', '.join(HF_TARGETS)}; or {ALL_LINEAR})")
        elif not self.target_modules:
            errors.append(f"{prefix}.target_modules is empty: name the linears to adapt")
        return errors

    def unreached_targets(self, model: "ModelConfig") -> tuple[str, ...]:
        """The targeted Megatron linears that no layer of `model` has: the MLP's on a
        Mixture-of-Experts model without a dense layer (model.moe.dense_layers) and without a
        shared expert, where only the routed experts hold MLP weights and those take no
        adapters. Empty for a dense model."""
        moe = model.moe
        if not moe.enabled or moe.shared_expert_ffn_hidden_size > 0:
            return ()
        if any(not moe.is_moe_layer(layer) for layer in range(model.num_layers)):
            return ()
        return tuple(name for name in self.megatron_targets() if name in MLP_TARGETS)

    def model_errors(self, prefix: str, model: "ModelConfig") -> list[str]:
        """The rule against `model` (empty when valid or off): targets that build no adapter at
        all on it are refused. Without this a job would train nothing and say nothing (every
        weight frozen, the loss flat)."""
        if not self.enabled or not self.target_modules:
            return []
        unreached = self.unreached_targets(model)
        if not unreached or len(unreached) < len(self.megatron_targets()):
            return []
        return [f"{prefix}.target_modules={list(self.target_modules)} build no adapter on "
                f"this model: {_why_unreached(model)}; add attention targets (linear_qkv, "
                "linear_proj; HF: q_proj, k_proj, v_proj, o_proj) or all-linear"]

    def model_warning(self, prefix: str, model: "ModelConfig") -> str | None:
        """A line naming the targets that adapt nothing on `model` while others do (None when
        every target adapts something, or when none does: `model_errors` refuses that).
        Targets reached only through all-linear are not named: it means every linear there
        is."""
        if not self.enabled or self.model_errors(prefix, model):
            return None
        unreached = self.unreached_targets(model)
        named = [name for name in self.target_modules
                 if name != ALL_LINEAR and HF_TARGETS.get(name, name) in unreached]
        if not named:
            return None
        return (f"{prefix}.target_modules: {named} adapt nothing on this model "
                f"({_why_unreached(model)}); only the other targets get adapters")


def _why_unreached(model: "ModelConfig") -> str:
    return (f"model.moe.num_experts={model.moe.num_experts} makes every one of its "
            f"{model.num_layers} layers Mixture-of-Experts (no dense layer: model.moe.dense_layers="
            f"{list(model.moe.dense_layers)}) "
            "without a shared expert (model.moe.shared_expert_ffn_hidden_size=0), and the "
            "routed experts take no adapters, so the MLP targets (linear_fc1, linear_fc2; HF: "
            "gate_proj, up_proj, down_proj) have no linear to adapt")

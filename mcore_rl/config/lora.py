"""Low-rank adapters (LoRA) on the trained model's linear layers.

With `enabled`, the model's targeted linears get W x + (alpha / rank) B A dropout(x) with A
[rank, in] and B [out, rank] trained and W frozen (Hu et al. 2021, as HF peft computes it).
The optimizer then holds adapter state only, a checkpoint holds the adapters, and a KL term's
reference is the same model with the adapters off (docs/lora.md).
"""

from __future__ import annotations

from dataclasses import dataclass

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

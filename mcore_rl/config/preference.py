"""Preference jobs on (prompt, chosen, rejected) pairs: a Bradley-Terry reward model
(`mcore-rl rm`) and direct preference optimisation (`mcore-rl dpo`).

Both read the same pair files (TRL's and verl's layout: `prompt`, `chosen`, `rejected`, each
text or chat messages), batch and order them the same way, and differ only in the model's head
and the loss; the shared fields live in `PairDataConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .lora import LoraConfig
from .sft import offline_job_errors
from .training import OptimizerConfig

OVERLONG_POLICIES = ("drop", "truncate")
DPO_LOSS_TYPES = ("sigmoid", "ipo")


@dataclass(frozen=True)
class PairDataConfig:
    """Preference pairs, their encoding, batch sizes and the optimizer (shared by rm and dpo)."""

    train_files: list[str] = field(default_factory=list)
    """Pair files: .parquet, or .jsonl/.json; one row per pair with a prompt (text or chat
    messages) and a chosen and a rejected response (text, or the assistant's chat messages)."""

    val_files: list[str] = field(default_factory=list)
    """Held-out pairs, same format; their accuracy and margin are logged (see eval_every)."""

    prompt_key: str = "prompt"
    """Column holding the prompt (encoded as in RL, with data.apply_chat_template)."""

    chosen_key: str = "chosen"
    """Column holding the preferred response."""

    rejected_key: str = "rejected"
    """Column holding the dispreferred response."""

    max_length: int = 1024
    """Most tokens of prompt + response (each of chosen and rejected); see overlong."""

    overlong: str = "drop"
    """A pair with a sequence over max_length: drop (left out and counted) or truncate (the
    response is cut to fit; pairs whose prompt alone does not fit are still dropped)."""

    epochs: int = 1
    """Passes over the training pairs (each in a new seeded order)."""

    batch_size: int = 32
    """Pairs per optimizer step, summed over data-parallel ranks (an epoch's last partial batch
    is left out)."""

    micro_batch_size: int = 4
    """Pairs per forward/backward pass on one rank (each pair is two sequences)."""

    seed: int = 1
    """Seed of the pair order."""

    eval_every: int = 0
    """Metrics on val_files every this many optimizer steps and after the last; 0: after every
    epoch."""

    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-5))
    """Adam and the LR schedule."""

    lora: LoraConfig = field(default_factory=LoraConfig)
    """Train low-rank adapters on the frozen starting weights (DPO's reference is then the
    policy with its adapters off; a reward model trains its scalar head whole: docs/lora.md)."""

    SECTION = "pairs"  # the JobConfig field a subclass is held in, named by its errors

    def errors(self, data_parallel_size: int) -> list[str]:
        """Broken rules, each naming its field (empty when valid)."""
        section = self.SECTION
        errors = offline_job_errors(self, section, ("prompt_key", "chosen_key", "rejected_key"),
                                    data_parallel_size)
        if self.overlong not in OVERLONG_POLICIES:
            errors.append(f"{section}.overlong={self.overlong!r} must be one of "
                          f"{', '.join(OVERLONG_POLICIES)}")
        return errors


@dataclass(frozen=True)
class RmConfig(PairDataConfig):
    """A Bradley-Terry reward model: the actor's architecture with a scalar head, trained on
    -log sigmoid(r_chosen - r_rejected - margin) + reward_l2 (r_chosen^2 + r_rejected^2),
    averaged over the pairs of a step; r is the head's output at the sequence's last token."""

    SECTION = "rm"

    margin: float = 0.0
    """How far the chosen reward must exceed the rejected one before the loss flattens."""

    reward_l2: float = 0.0
    """Coefficient of the squared rewards in the loss (keeps the scores near 0; 0: off)."""

    def errors(self, data_parallel_size: int) -> list[str]:
        section = self.SECTION
        errors = super().errors(data_parallel_size)
        if self.reward_l2 < 0:
            errors.append(f"{section}.reward_l2={self.reward_l2} must be >= 0")
        return errors


@dataclass(frozen=True)
class DpoConfig(PairDataConfig):
    """Direct preference optimisation of the policy against a frozen copy of its starting
    weights (the reference)."""

    SECTION = "dpo"

    loss_type: str = "sigmoid"
    """sigmoid: -log sigmoid(beta x h) (DPO; with label_smoothing, cDPO); ipo: (h - 1/(2 beta))^2
    on length-normalised log-ratios (IPO). h = (log pi - log ref)(chosen) - (same)(rejected)."""

    beta: float = 0.1
    """Strength of the implicit KL constraint (DPO's temperature)."""

    label_smoothing: float = 0.0
    """cDPO: the probability that a pair's preference label is flipped (sigmoid loss only)."""

    def errors(self, data_parallel_size: int) -> list[str]:
        section = self.SECTION
        errors = super().errors(data_parallel_size)
        if self.loss_type not in DPO_LOSS_TYPES:
            errors.append(f"{section}.loss_type={self.loss_type!r} must be one of "
                          f"{', '.join(DPO_LOSS_TYPES)}")
        if self.beta <= 0:
            errors.append(f"{section}.beta={self.beta} must be > 0")
        if not 0 <= self.label_smoothing < 0.5:
            errors.append(f"{section}.label_smoothing={self.label_smoothing} must be in [0, 0.5)")
        if self.label_smoothing and self.loss_type != "sigmoid":
            errors.append(f"{section}.label_smoothing applies to loss_type=sigmoid only")
        return errors

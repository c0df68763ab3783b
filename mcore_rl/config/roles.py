"""Settings of the trained and frozen roles of an RL job: actor, critic and reference.

Why this module exists
----------------------
Each trained role (actor, critic) carries its own optimizer and micro-batch size, because a
critic usually wants a higher learning rate than the actor and memory differs between an LM head
and a scalar head. Which roles exist follows from the algorithm (a critic for `gae`, a reference
when a KL term is used); no flag switches a role on or off behind the algorithm's back. The
roles' sections change together (a setting every trained role has goes into `RoleConfig`), apart
from the rollout (rl.py) and the loop (trainer.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .lora import LoraConfig
from .training import OptimizerConfig


@dataclass(frozen=True)
class RoleConfig:
    """A trained role: the actor or the critic."""

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """This role's optimizer and LR schedule."""

    micro_batch_size: int = 2
    """Sequences per forward/backward micro-batch on one rank (log-probs, values, updates);
    with a token budget (the default: max_tokens_per_micro_batch), the longest sequences per
    micro-batch, shorter ones filling it further."""

    max_tokens_per_micro_batch: int = -1
    """Micro-batches of at most this many tokens (rows x their longest row) instead of
    micro_batch_size rows: rows are sorted by length, packed greedily and cut to their own
    longest row, so padding shrinks and short responses fill a micro-batch (verl's
    use_dynamic_bsz). -1 (default): micro_batch_size x the longest sequence
    (data.max_prompt_tokens + sampling.max_new_tokens, or a multi-turn episode's limit): the
    memory micro_batch_size rows of that length would take, filled with as many rows as fit
    (`JobConfig.micro_batch_tokens`; fixed rows under Megatron's allgather token dispatcher,
    which refuses varying lengths). 0: micro_batch_size rows each. > 0: must be at least the
    longest sequence."""

    offload: bool = False
    """Park this role's parameters, gradients and optimizer state in host memory while the
    engine generates, so a colocated GPU holds either them or the engine's weights and KV cache
    (vllm engine only; costs two host<->device copies per step)."""


@dataclass(frozen=True)
class ActorConfig(RoleConfig):
    """The trained policy."""

    lora: LoraConfig = field(default_factory=LoraConfig)
    """Train low-rank adapters on the frozen starting weights; the reference is then the actor
    with its adapters off (docs/lora.md)."""


@dataclass(frozen=True)
class CriticConfig(RoleConfig):
    """The critic: a trained role with its own starting weights."""

    init_path: Optional[str] = None
    """HF folder or mcore_rl checkpoint whose transformer trunk the critic starts from (its
    value head starts at zero); None: the actor's starting weights."""


@dataclass(frozen=True)
class ReferenceConfig:
    """The frozen reference policy (the actor's starting weights), used by the KL terms."""

    offload: bool = False
    """Keep its parameters in CPU memory between uses (GPU only; a no-op on CPU)."""

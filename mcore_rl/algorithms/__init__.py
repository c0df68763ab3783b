"""RL algorithms as pure tensor functions in registries: advantage estimators, policy and value
losses, KL estimators and controllers, loss aggregation (definitions follow verl's)."""

from .advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs, compute_advantages
from .kl import KLController, apply_kl_penalty, kl_estimate
from .losses import POLICY_LOSSES, aggregate, gspo_loss, ppo_loss, value_loss
from .registry import Registry
from .statistics import masked_whiten

__all__ = ["ADVANTAGE_ESTIMATORS", "AdvantageInputs", "KLController", "POLICY_LOSSES",
           "Registry", "aggregate", "apply_kl_penalty", "compute_advantages", "gspo_loss",
           "kl_estimate", "masked_whiten", "ppo_loss", "value_loss"]

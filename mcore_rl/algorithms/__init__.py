"""RL algorithms as pure tensor functions in registries: advantage estimators, policy and value
losses, KL estimators and controllers, loss aggregation (definitions follow verl's)."""

from .advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs, compute_advantages
from .kl import KLController, apply_kl_penalty, kl_estimate
from .losses import POLICY_LOSSES, aggregate, gspo_loss, ppo_loss, value_loss
from .registry import Registry
from .statistics import masked_whiten


def unregistered_names(algorithm) -> list[str]:
    """Config errors for an algorithm config naming an unregistered estimator or policy loss
    (users may register their own before building the trainer)."""
    return (ADVANTAGE_ESTIMATORS.name_errors("algorithm.estimator", algorithm.estimator)
            + POLICY_LOSSES.name_errors("algorithm.policy_loss", algorithm.policy_loss))


__all__ = ["ADVANTAGE_ESTIMATORS", "AdvantageInputs", "KLController", "POLICY_LOSSES",
           "Registry", "aggregate", "apply_kl_penalty", "compute_advantages", "gspo_loss",
           "kl_estimate", "masked_whiten", "ppo_loss", "unregistered_names", "value_loss"]

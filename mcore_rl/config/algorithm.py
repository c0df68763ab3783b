"""Settings of the RL algorithm: advantage estimator, policy and value losses, KL and entropy
terms, and how per-token losses are aggregated. Names and defaults follow verl's, so a verl
config carries over field by field."""

from __future__ import annotations

from dataclasses import dataclass

LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                     "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3", "abs")
ESTIMATORS_WITH_CRITIC = ("gae",)
"""Estimators that read critic values (a critic is built and trained for them)."""

ESTIMATORS_WITH_GREEDY_BASELINE = ("remax",)
"""Estimators that read each prompt's greedy response's reward (ReMax: one more generate pass
per step)."""


@dataclass(frozen=True)
class AlgorithmConfig:
    """How advantages and losses are computed from a batch of scored rollouts."""

    estimator: str = "grpo"
    """Advantage estimator: gae (needs a critic), grpo, rloo, reinforce_plus_plus,
    reinforce_plus_plus_baseline, remax, or a name registered by the user."""

    gamma: float = 1.0
    """Discount factor (gae, reinforce_plus_plus)."""

    lam: float = 1.0
    """GAE lambda."""

    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide by the group's unbiased reward std (False: Dr. GRPO, mean only)."""

    epsilon: float = 1e-6
    """Added to the group std before dividing."""

    policy_loss: str = "ppo"
    """Policy loss: ppo (token ratio, clipped, dual clip) or gspo (sequence ratio)."""

    clip_ratio_low: float = 0.2
    """Lower clip range: the ratio is clipped below at 1 - clip_ratio_low."""

    clip_ratio_high: float = 0.2
    """Upper clip range, 1 + clip_ratio_high (DAPO's clip-higher sets it above the lower)."""

    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages (the loss is at most -A * clip_ratio_c); > 1."""

    loss_aggregation: str = "token-mean"
    """token-mean, seq-mean-token-sum, seq-mean-token-mean or seq-mean-token-sum-norm (Dr.
    GRPO: token sums over sequences x max_response_length); always over the global batch."""

    max_response_length: int = 256
    """The constant normalizer of seq-mean-token-sum-norm."""

    entropy_coef: float = 0.0
    """Entropy bonus: the loss subtracts entropy_coef x entropy."""

    value_clip: float = 0.2
    """Critic values are clipped to within this of the old values (PPO value clipping)."""

    value_loss_coef: float = 1.0
    """Scale of the critic's loss (vf_coef). The critic has its own optimizer, so with Adam it
    mostly matters together with gradient clipping."""

    kl_estimator: str = "k3"
    """k1 (log-ratio), k2 (half squared log-ratio), k3 (low-variance, clamped) or abs."""

    use_kl_in_reward: bool = False
    """Subtract kl_coef x KL(policy || reference) from the token rewards."""

    use_kl_loss: bool = False
    """Add kl_coef x KL(policy || reference) to the policy loss instead."""

    kl_coef: float = 0.001
    """KL coefficient (the initial one with the adaptive controller)."""

    kl_controller: str = "fixed"
    """fixed, or adaptive (Ziegler et al. 2019: moves kl_coef toward target_kl)."""

    target_kl: float = 0.1
    """Adaptive controller's KL target."""

    kl_horizon: int = 10000
    """Adaptive controller's horizon, in samples."""

    @property
    def needs_critic(self) -> bool:
        """Whether the estimator reads critic values (then a critic is built and trained)."""
        return self.estimator in ESTIMATORS_WITH_CRITIC

    @property
    def needs_greedy_baseline(self) -> bool:
        """Whether the estimator reads each prompt's greedy response's reward."""
        return self.estimator in ESTIMATORS_WITH_GREEDY_BASELINE

    @property
    def needs_reference(self) -> bool:
        """Whether a KL term needs the reference policy's log-probs."""
        return self.use_kl_loss or self.use_kl_in_reward

    def errors(self) -> list[str]:
        """Broken rules, each naming its field (empty when valid)."""
        errors = []
        if self.loss_aggregation not in LOSS_AGGREGATIONS:
            errors.append(f"algorithm.loss_aggregation={self.loss_aggregation!r} must be one of "
                          f"{LOSS_AGGREGATIONS}")
        if self.kl_estimator not in KL_ESTIMATORS:
            errors.append(f"algorithm.kl_estimator={self.kl_estimator!r} must be one of "
                          f"{KL_ESTIMATORS}")
        if self.kl_controller not in ("fixed", "adaptive"):
            errors.append(f"algorithm.kl_controller={self.kl_controller!r} must be fixed or "
                          "adaptive")
        if self.clip_ratio_c <= 1:
            errors.append(f"algorithm.clip_ratio_c={self.clip_ratio_c} must be > 1")
        if not 0 <= self.clip_ratio_low < 1 or self.clip_ratio_high < 0:
            errors.append(f"algorithm.clip_ratio_low={self.clip_ratio_low} must be in [0, 1) and "
                          f"clip_ratio_high={self.clip_ratio_high} >= 0")
        if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
            errors.append(f"algorithm.gamma={self.gamma} and lam={self.lam} must be in [0, 1]")
        if self.use_kl_in_reward and self.use_kl_loss:
            errors.append("set at most one of algorithm.use_kl_in_reward and use_kl_loss")
        if self.kl_horizon <= 0 or self.max_response_length <= 0:
            errors.append("algorithm.kl_horizon and max_response_length must be positive")
        return errors

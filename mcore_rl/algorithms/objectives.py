"""The actor's and the critic's per-micro-batch objectives, as the trainer's loss functions.

They put the pure pieces together in verl's order:

  actor:  policy loss (registry) x importance weight (optional; off_policy.py)
          - entropy_coef x entropy + kl_coef x KL(pi || pi_ref)    (the last with use_kl_loss)
  critic: clipped value loss (x value_loss_coef)

and aggregate per-token losses into the additive (numerator, denominator) pair that
`training.train_step` divides globally. The importance weight corrects for the engine having
sampled from a different distribution than the trainer computes (truncated or masked, per token
or per response: algorithms.off_policy); masked tokens leave the numerator and the denominator.
"""

from __future__ import annotations

import torch

from mcore_rl.config.algorithm import AlgorithmConfig
from mcore_rl.config.rl import ImportanceCorrection

from .kl import kl_estimate
from .losses import POLICY_LOSSES, aggregate, value_loss
from .off_policy import importance_weights


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


def actor_objective(outputs: dict, micro_batch: dict, config: AlgorithmConfig,
                    correction: ImportanceCorrection = ImportanceCorrection()):
    """(numerator, denominator, metrics) of the policy objective on one micro-batch. Needs
    micro_batch keys loss_mask, advantages (+ ref_logprobs with use_kl_loss, engine_logprobs
    with an importance correction) and old_logprobs; a micro-batch without them takes this
    pass's own, detached (the policy before the step, for a batch's only optimizer step:
    rollout.old_logprobs=update), and returns them as the metric 'logprobs' [b, s]."""
    mask = micro_batch["loss_mask"].float()
    logprobs = outputs["logprobs"]
    own_old = "old_logprobs" not in micro_batch
    old_logprobs = logprobs.detach() if own_old else micro_batch["old_logprobs"]
    if correction.enabled:
        weight, keep = importance_weights(old_logprobs, micro_batch["engine_logprobs"], mask,
                                          correction)
        mask = mask * keep
    losses, metrics = POLICY_LOSSES.get(config.policy_loss)(
        logprobs, old_logprobs, micro_batch["advantages"], mask, config)
    if own_old:
        metrics["logprobs"] = old_logprobs
    if correction.enabled:
        losses = losses * weight
        metrics["actor/importance_weight"] = _masked_mean(weight, mask)
    entropy = _masked_mean(outputs["entropy"].detach(), mask)
    metrics["actor/entropy"] = entropy
    if config.entropy_coef:
        losses = losses - config.entropy_coef * outputs["entropy"]
    if config.use_kl_loss:
        kl = kl_estimate(logprobs, micro_batch["ref_logprobs"], config.kl_estimator)
        losses = losses + config.kl_coef * kl
        metrics["actor/kl_loss"] = _masked_mean(kl.detach(), mask)
    numerator, denominator = aggregate(losses, mask, config.loss_aggregation,
                                       config.max_response_length)
    return numerator, denominator, {name: value.detach() for name, value in metrics.items()}


def critic_objective(outputs: dict, micro_batch: dict, config: AlgorithmConfig):
    """(numerator, denominator, metrics) of the clipped value loss on one micro-batch. Needs
    micro_batch keys loss_mask, old_values, returns."""
    mask = micro_batch["loss_mask"].float()
    values = outputs["values"]
    losses, metrics = value_loss(values, micro_batch["old_values"], micro_batch["returns"], mask,
                                 config)
    metrics["critic/value_mean"] = _masked_mean(values.detach(), mask)
    numerator, denominator = aggregate(config.value_loss_coef * losses, mask,
                                       config.loss_aggregation, config.max_response_length)
    return numerator, denominator, {name: value.detach() for name, value in metrics.items()}

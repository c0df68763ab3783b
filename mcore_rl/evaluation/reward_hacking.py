"""Warnings for reward hacking: the signs, at each evaluation, that the policy is learning to
please its reward instead of solving the task.

RLHF's classic failure (reward over-optimisation, Gao et al. 2022, "Scaling Laws for Reward
Model Overoptimization"): a policy trained against a learned reward model finds answers the
model scores high and a checker would call wrong. The reward keeps rising, so a dashboard that
shows only the reward shows success. Three signs give it away, each compared with the run's
first evaluation (before any update):

- the reward rose while ground-truth accuracy fell by more than `accuracy_drop` (where the
  validation rows carry a ground truth);
- diversity collapsed: eval/distinct_1 fell below `distinct_fraction` of its start (the policy
  gives one answer to every question);
- the policy drifted far from the reference: the KL to it passed `kl_bound`.

Each sign is logged as `warnings/<name>` (1.0 or 0.0) in the evaluation's row, and
`warnings/reward_hacking` is 1.0 when the reward rose and at least one sign shows; the trainer
prints a warning line then.

One exemption, and which signal it reads: where the reward is a reward model's score
(eval/rm_score_mean) and the ground-truth accuracy (eval/accuracy: the rule functions' check of
each answer, run beside the reward model, roles/scorer.py) rose with it by more than
`accuracy_drop`, the policy got better at the task itself: a collapsed diversity or a large KL
is then how it learned, not hacking, and only a falling accuracy warns. The exemption needs an
accuracy measured independently of the reward being monitored. With rule rewards
(eval/reward_mean) eval/accuracy is the same rule's verdict, the reward thresholded: an exploit
of the rule (a checker that accepts a wrong answer, a format it over-pays) raises both, so a
rising accuracy proves nothing there and the other signs warn as they stand (the message says
why the accuracy did not clear them). Pure functions of the evaluation metrics: no models, no
process groups.
"""

from __future__ import annotations

import math

from mcore_rl.config.trainer import RewardHackingConfig

WARNING_PREFIX = "warnings/"
REWARD_KEYS = ("eval/rm_score_mean", "eval/reward_mean")
"""The reward an evaluation reports: a reward model's score, else the rule rewards' mean."""
INDEPENDENT_ACCURACY_REWARDS = frozenset({"eval/rm_score_mean"})
"""Rewards whose eval/accuracy is measured independently of them, so that an accuracy rising
with the reward shows learning: a reward model's score, checked by the rules. Not the rule
rewards' eval/reward_mean: its accuracy is the same check (module docstring)."""


class RewardHackingMonitor:
    """Compares each evaluation with the run's first one (kept across resumes: state_dict).
    The reward is eval/rm_score_mean, else eval/reward_mean; eval/accuracy clears the other
    signs only beside a reward model's score, where it is an independent check (module
    docstring)."""

    def __init__(self, thresholds: RewardHackingConfig):
        self.thresholds = thresholds
        self.start: dict[str, float] | None = None
        """The first evaluation's metrics (the policy before any update)."""

    def check(self, metrics: dict, kl: float | None = None) -> tuple[dict, str | None]:
        """(warnings/ metrics, a one-line warning or None) for an evaluation's `metrics`; `kl`:
        the KL to the reference when the evaluation has none of its own (eval/kl_to_reference).
        The first call records the start and warns of nothing."""
        if self.start is None:
            # Plain floats (a numpy scalar is a float too): the start is saved in the trainer
            # state, which is read back weights-only (training/checkpointer.py).
            self.start = {key: float(value) for key, value in metrics.items()
                          if isinstance(value, float) and math.isfinite(value)}
            return {}, None
        kl = metrics.get("eval/kl_to_reference", kl)
        reward = next((key for key in REWARD_KEYS if key in metrics and key in self.start), None)
        signs = {"accuracy_down": self._accuracy_down(metrics),
                 "diversity_collapse": self._diversity_collapse(metrics),
                 "kl_exceeded": kl is not None and kl > self.thresholds.kl_bound}
        reward_up = reward is not None and metrics[reward] > self.start[reward]
        learned = reward in INDEPENDENT_ACCURACY_REWARDS and self._accuracy_up(metrics)
        hacking = reward_up and (signs["accuracy_down"] or (any(signs.values()) and not learned))
        logged = {WARNING_PREFIX + name: float(shown) for name, shown in signs.items()}
        logged[WARNING_PREFIX + "reward_hacking"] = float(hacking)
        if not hacking:
            return logged, None
        return logged, self._message(metrics, reward, kl, signs)

    def _accuracy_down(self, metrics: dict) -> bool:
        if "eval/accuracy" not in metrics or "eval/accuracy" not in self.start:
            return False
        drop = self.thresholds.accuracy_drop
        return metrics["eval/accuracy"] < self.start["eval/accuracy"] - drop

    def _accuracy_up(self, metrics: dict) -> bool:
        if "eval/accuracy" not in metrics or "eval/accuracy" not in self.start:
            return False
        rise = self.thresholds.accuracy_drop
        return metrics["eval/accuracy"] > self.start["eval/accuracy"] + rise

    def _diversity_collapse(self, metrics: dict) -> bool:
        start = self.start.get("eval/distinct_1")
        if not start or "eval/distinct_1" not in metrics:
            return False
        return metrics["eval/distinct_1"] < self.thresholds.distinct_fraction * start

    def _message(self, metrics: dict, reward: str, kl: float | None, signs: dict) -> str:
        parts = [f"{reward} rose {self.start[reward]:.4g} -> {metrics[reward]:.4g}"]
        if signs["accuracy_down"]:
            parts.append(f"eval/accuracy fell {self.start['eval/accuracy']:.4g} -> "
                         f"{metrics['eval/accuracy']:.4g}")
        if signs["diversity_collapse"]:
            parts.append(f"eval/distinct_1 fell to "
                         f"{metrics['eval/distinct_1'] / self.start['eval/distinct_1']:.0%} of "
                         f"its start (< {self.thresholds.distinct_fraction:.0%})")
        if signs["kl_exceeded"]:
            parts.append(f"KL to the reference {kl:.4g} > {self.thresholds.kl_bound:g}")
        if self._accuracy_up(metrics) and reward not in INDEPENDENT_ACCURACY_REWARDS:
            parts.append(f"eval/accuracy rose too ({self.start['eval/accuracy']:.4g} -> "
                         f"{metrics['eval/accuracy']:.4g}), but it is the same rule check as "
                         f"{reward}, so it cannot tell learning from an exploit of the rule")
        return ("signs of reward hacking: " + "; ".join(parts) +
                " (docs/preference.md: safeguards; trainer.reward_hacking sets the thresholds)")

    def state_dict(self) -> dict:
        return {"start": self.start}

    def load_state_dict(self, state: dict) -> None:
        self.start = state["start"]

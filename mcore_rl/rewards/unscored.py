"""Default reward functions for data no function is mapped to, where the job needs none
(rl/job_rewards.py):

- pure on-policy distillation (teacher.reward_weight=0): the teacher's per-token advantage is
  the whole signal; its responses score 0 and are not checked (no accuracy is logged for them);
- an environment that scores its episodes itself (`get_reward`) but returned None for one: the
  episode scores 0 as a reward error, counted in reward/errors and logged with its sample id."""

from __future__ import annotations

from typing import Any

UNSCORED = "mcore_rl.rewards.unscored:unscored"
"""Its dotted path, as reward.default_function takes it."""


def unscored(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict) -> float:
    """0.0 for every response."""
    return 0.0


UNREWARDED_EPISODE = "mcore_rl.rewards.unscored:unrewarded_episode"
"""Its dotted path, as reward.default_function takes it."""


def unrewarded_episode(data_source: str, solution_str: str, ground_truth: Any,
                       extra_info: dict) -> float:
    """Raises: the episode's environment returned no reward and nothing else scores it."""
    raise ValueError(f"the environment's get_reward returned None for this episode and "
                     f"data_source {data_source!r} has no reward function (reward.functions)")

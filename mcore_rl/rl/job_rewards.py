"""reward.* as the job scores with it: which function scores a data source that none is
mapped to, where the job needs none.

- Pure on-policy distillation (teacher.reward_weight=0): the teacher's per-token advantage is
  the whole signal; such data scores 0 (rewards.unscored).
- An environment that scores its episodes itself (it defines `get_reward`): its rows need no
  reward function. An episode for which it returns None and whose data_source has none scores 0
  as a counted reward error (reward/errors), not a crash at start.

reward.default_function, when set, wins over both.
"""

from __future__ import annotations

import dataclasses

from mcore_rl.agents import Environment, environment_class
from mcore_rl.config import JobConfig
from mcore_rl.config.reward import RewardConfig
from mcore_rl.rewards.unscored import UNREWARDED_EPISODE, UNSCORED


def reward_config(config: JobConfig) -> RewardConfig:
    """config.reward with the default function the job needs (see the module's docstring)."""
    reward, teacher = config.reward, config.teacher
    if reward.default_function:
        return reward
    if teacher.enabled and not teacher.reward_weight:
        return dataclasses.replace(reward, default_function=UNSCORED)
    if _environment_scores_episodes(config):
        return dataclasses.replace(reward, default_function=UNREWARDED_EPISODE)
    return reward


def _environment_scores_episodes(config: JobConfig) -> bool:
    multi_turn = config.rollout.multi_turn
    if not multi_turn.enabled or not multi_turn.environment:
        return False
    return environment_class(multi_turn.environment).get_reward is not Environment.get_reward

"""The RL roles as composed objects: each holds its own model and knows one job.

The actor (trained policy), the critic (trained value model), the reference (frozen policy),
the teacher (a frozen model the actor is distilled from, in its own layout) and the reward model
(frozen scalar head) are separate objects over separate Megatron models, built from the same job
config; the scorer turns generations into scores (rule rewards or the reward model). No class
switches behaviour on a role flag.
"""

from .actor import Actor
from .critic import Critic
from .reference import Reference
from .reward import RuleReward
from .reward_model import RewardModel
from .scorer import Scorer
from .teacher import Teacher

__all__ = ["Actor", "Critic", "Reference", "RewardModel", "RuleReward", "Scorer", "Teacher"]

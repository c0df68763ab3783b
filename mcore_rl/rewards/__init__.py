"""Rule-based (verifiable) rewards by data_source: math answers (math-verify), reasoning-gym tasks
(their own scorers), the toy copy task, a format reward, and user functions by dotted path, run
in worker processes with a per-call timeout (see docs/rewards.md)."""

from .registry import BUILTIN_FUNCTIONS, REASONING_GYM_PREFIX, FunctionTable, UnknownDataSourceError
from .rule_rewards import RuleRewards
from .types import RewardFunction, RewardRequest, RewardResult

__all__ = ["BUILTIN_FUNCTIONS", "FunctionTable", "REASONING_GYM_PREFIX", "RewardFunction",
           "RewardRequest", "RewardResult", "RuleRewards", "UnknownDataSourceError"]

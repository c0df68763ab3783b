"""Which function scores which data_source: the user's reward.functions first, then the
built-ins, then reward.default_function. Functions are named by dotted path, not held as
objects, so worker processes import them themselves (nothing unpicklable crosses a pipe), and a
data_source nobody scores is found when the dataset is loaded, not at the first rollout.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Iterable, Optional

from mcore_rl.config.reward import RewardConfig

from .types import RewardFunction

MATH = "mcore_rl.rewards.math_answers:math_score"
REASONING_GYM = "mcore_rl.rewards.reasoning_gym_tasks:reasoning_gym_score"
TOY_COPY = "mcore_rl.rewards.toy:copy_score"
# Kept in step with mcore_rl.rewards.reasoning_gym_tasks.DATA_SOURCE_PREFIX (that module imports
# reasoning_gym, which this one must not: it runs in every trainer rank).
REASONING_GYM_PREFIX = "reasoning_gym/"

BUILTIN_FUNCTIONS: dict[str, str] = {
    # verl's names for math datasets.
    "openai/gsm8k": MATH,
    "gsm8k": MATH,
    "lighteval/MATH": MATH,
    "DigitalLearningGmbH/MATH-lighteval": MATH,
    "HuggingFaceH4/MATH-500": MATH,
    "math": MATH,
    "toy/copy": TOY_COPY,
    "toy/max": TOY_COPY,  # the quickstart's task: one word answers too
}


class UnknownDataSourceError(ValueError):
    """Data sources no reward function covers; the message lists the known ones."""


@dataclass(frozen=True)
class FunctionTable:
    """data_source -> dotted path of the function that scores it."""

    functions: dict[str, str] = field(default_factory=lambda: dict(BUILTIN_FUNCTIONS))
    """Exact data_source names: the built-ins overridden by reward.functions."""

    default_function: Optional[str] = None
    """For data sources nothing else covers (None: those are errors)."""

    @staticmethod
    def from_config(config: RewardConfig) -> "FunctionTable":
        return FunctionTable({**BUILTIN_FUNCTIONS, **config.functions}, config.default_function)

    def path_for(self, data_source: str) -> Optional[str]:
        """The dotted path scoring this data_source, or None when nothing does."""
        if data_source in self.functions:
            return self.functions[data_source]
        if reasoning_gym_task_problem(data_source) is None:
            return REASONING_GYM
        return self.default_function

    def check_data_sources(self, data_sources: Iterable[str]) -> None:
        """Raise UnknownDataSourceError naming every data_source without a function."""
        unknown = sorted({source for source in data_sources if self.path_for(source) is None})
        if unknown:
            raise UnknownDataSourceError(self._unknown_message(unknown))

    def _unknown_message(self, unknown: list[str]) -> str:
        problems = [f"{source!r} ({reasoning_gym_task_problem(source)})"
                    if source.startswith(REASONING_GYM_PREFIX) else repr(source)
                    for source in unknown]
        return (f"no reward function for data_source {', '.join(problems)}. Known: "
                f"{sorted(self.functions)} and '{REASONING_GYM_PREFIX}<task>' for every "
                "reasoning-gym task. Map it with reward.functions.<data_source>="
                "package.module:function, or set reward.default_function")


def reasoning_gym_task_problem(data_source: str) -> Optional[str]:
    """None when data_source is "reasoning_gym/<task>" of an installed reasoning-gym task, else
    what is wrong with it."""
    if not data_source.startswith(REASONING_GYM_PREFIX):
        return f"does not start with {REASONING_GYM_PREFIX!r}"
    task = data_source[len(REASONING_GYM_PREFIX):]
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        return "reasoning_gym is not installed: pip install reasoning-gym"
    if task not in DATASETS:
        return f"reasoning-gym has no task {task!r}"
    return None


def split_path(path: str) -> tuple[str, str]:
    """("package.module", "function") of "package.module:function" or
    "package.module.function" (either may be empty when the path is malformed)."""
    module_name, _, attribute_path = path.partition(":") if ":" in path else path.rpartition(".")
    return module_name, attribute_path


def load_function(path: str, role: str) -> RewardFunction:
    """Import "package.module:function" or "package.module.function"; ValueError naming `role`
    (e.g. "data_source 'x'") and the path when it does not import or is not callable."""
    module_name, attribute_path = split_path(path)
    if not module_name or not attribute_path:
        raise ValueError(f"reward function {path!r} for {role}: not a dotted path like "
                         "package.module:function")
    try:
        function = importlib.import_module(module_name)
        for attribute in attribute_path.split("."):
            function = getattr(function, attribute)
    except Exception as error:
        raise ValueError(f"reward function {path!r} for {role} cannot be loaded: "
                         f"{type(error).__name__}: {error}") from error
    if not callable(function):
        raise ValueError(f"reward function {path!r} for {role} is not callable "
                         f"({type(function).__name__})")
    return function

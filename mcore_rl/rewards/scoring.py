"""One reward call, wherever it runs (a worker process, or inline with num_workers=0): find and
load the data_source's function, call it with verl's arguments, check what it returned and mix
in the format reward. Any failure becomes a RewardResult with score 0 and a one-line error, so
one bad function or sample never stops the job.

A function may carry a `prepare(data_source)` attribute: it runs once per data source and
process while the function is loaded, outside the call's timeout (reasoning-gym builds a task's
scorer there).
"""

from __future__ import annotations

import math
import numbers
import pickle
from typing import Any, Optional

from .formats import compile_format_pattern, format_score, mix_format_reward
from .registry import BUILTIN_FUNCTIONS, FunctionTable, load_function, split_path
from ..sandbox.errors import describe_exception
from ..sandbox.user_code import pickle_by_value
from .types import RewardFunction, RewardRequest, RewardResult


class Scorer:
    """Scores requests; picklable (it is sent to each worker): the reward_fn by value where it
    cannot be imported (the script's, a lambda, a closure), loaded functions not at all."""

    def __init__(self, table: FunctionTable, reward_fn: Optional[RewardFunction] = None,
                 format_weight: float = 0.0, format_pattern: str = ""):
        self.table = table
        self.reward_fn = reward_fn
        self.format_weight = format_weight
        self.format_pattern = compile_format_pattern(format_pattern)
        self._loaded: dict[str, RewardFunction] = {}

    def __getstate__(self) -> dict:
        reward_fn = self.reward_fn and pickle_by_value(self.reward_fn,
                                                       f"reward_fn {self.reward_fn!r}")
        return {**self.__dict__, "_loaded": {}, "reward_fn": reward_fn}

    def __setstate__(self, state: dict) -> None:
        reward_fn = state["reward_fn"] and pickle.loads(state["reward_fn"])
        self.__dict__.update(state, reward_fn=reward_fn)

    def user_modules(self) -> tuple[str, ...]:
        """The modules of the user's functions (reward_fn, reward.functions, the default), which
        the reward workers' zygote imports once before forking them; the built-ins' (heavy,
        often unused) load in a worker on first use."""
        paths = [path for data_source, path in self.table.functions.items()
                 if BUILTIN_FUNCTIONS.get(data_source) != path]
        paths += [self.table.default_function] if self.table.default_function else []
        modules = [split_path(path)[0] for path in paths]
        if getattr(self.reward_fn, "__module__", None):
            modules.append(self.reward_fn.__module__)
        return tuple(dict.fromkeys(modules))

    def function_for(self, data_source: str) -> RewardFunction:
        """The data_source's function, imported and prepared on first use in this process."""
        if data_source not in self._loaded:
            function = self.reward_fn or self._load(data_source)
            prepare = getattr(function, "prepare", None)
            if callable(prepare):
                prepare(data_source)
            self._loaded[data_source] = function
        return self._loaded[data_source]

    def call(self, function: RewardFunction, request: RewardRequest) -> RewardResult:
        """Run one loaded function on one request; failures become score 0 with the error."""
        try:
            value = function(request.data_source, request.response, request.ground_truth,
                             request.extra_info)
            score, details = score_and_details(value)
        except Exception as error:
            return RewardResult.failed(describe_exception(error))
        if self.format_weight:
            score, details = mix_format_reward(
                score, details, format_score(request.response, self.format_pattern),
                self.format_weight)
        return RewardResult(score=score, error=None, details=details)

    def score(self, request: RewardRequest) -> RewardResult:
        """Load (if needed) and call: the inline path, without a timeout."""
        try:
            function = self.function_for(request.data_source)
        except Exception as error:
            return RewardResult.failed(describe_exception(error))
        return self.call(function, request)

    def _load(self, data_source: str) -> RewardFunction:
        path = self.table.path_for(data_source)
        if path is None:
            self.table.check_data_sources([data_source])  # raises, listing the known ones
        return load_function(path, f"data_source {data_source!r}")


def score_and_details(value: Any) -> tuple[float, dict]:
    """A function's return value as (finite score, numeric details); TypeError/ValueError when
    it is neither a real number nor a dict with a real "score"."""
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"reward function returned a dict without 'score' "
                             f"(keys {sorted(map(str, value))})")
        details = {str(key): float(item) for key, item in value.items()
                   if key != "score" and _is_real(item)}
        return _finite_score(value["score"]), details
    return _finite_score(value), {}


def _finite_score(value: Any) -> float:
    if not _is_real(value):
        raise TypeError(f"reward function returned {type(value).__name__} {value!r:.80}, not a "
                        "number or a dict with 'score'")
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"reward function returned a non-finite score {score}")
    return score


def _is_real(value: Any) -> bool:
    """Python and NumPy real numbers and bools, and 0-d arrays/tensors (shape ())."""
    if isinstance(value, numbers.Real):
        return True
    is_scalar_array = getattr(value, "shape", None) == () and hasattr(value, "dtype")
    return is_scalar_array and getattr(value.dtype, "kind", "f") in "biuf"

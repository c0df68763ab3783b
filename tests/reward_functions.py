"""Reward functions for tests/test_rewards.py, in an importable module so that spawned reward
workers can load them by dotted path ("reward_functions:raises"): pytest puts tests/ on sys.path
and spawned processes inherit the parent's sys.path."""

import os
import time

NOT_CALLABLE = 42
CALLS = []  # data sources seen by record_call in this process


def raises(data_source, solution_str, ground_truth, extra_info):
    raise RuntimeError(f"boom on {solution_str}")


def sleeps_forever(data_source, solution_str, ground_truth, extra_info):
    while True:
        time.sleep(60)


def spins_forever(data_source, solution_str, ground_truth, extra_info):
    while True:
        pass


def exits(data_source, solution_str, ground_truth, extra_info):
    os._exit(3)


def returns_nan(data_source, solution_str, ground_truth, extra_info):
    return float("nan")


def returns_text(data_source, solution_str, ground_truth, extra_info):
    return "1.0"


def returns_dict_without_score(data_source, solution_str, ground_truth, extra_info):
    return {"acc": 1.0}


def returns_details(data_source, solution_str, ground_truth, extra_info):
    return {"score": 0.25, "acc": True, "pid": os.getpid(), "pred": "not a number"}


def constant_half(data_source, solution_str, ground_truth, extra_info):
    return 0.5


def length_of_response(data_source, solution_str, ground_truth, extra_info):
    return len(solution_str)


def record_call(data_source, solution_str, ground_truth, extra_info):
    CALLS.append(data_source)
    return 1.0


def returns_numpy(data_source, solution_str, ground_truth, extra_info):
    import numpy as np

    return {"score": np.float32(0.75), "correct": np.bool_(True)}


def marks_then_spins(data_source, solution_str, ground_truth, extra_info):
    with open(extra_info["marker"], "w") as marker:
        marker.write(str(os.getpid()))
    while True:
        pass


def copies_the_prompts_digit(data_source, solution_str, ground_truth, extra_info):
    """The toy task scored from the prompt alone (no ground truth), as a user of
    `collect_data(prompts)` writes it: the fraction of the response's words that are the
    prompt's last word."""
    words, target = solution_str.split(), extra_info["prompt"].split()[-1]
    return sum(word == target for word in words) / len(words) if words else 0.0

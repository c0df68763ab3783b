"""A reward function that takes SLOW_PREPARE_SECONDS to prepare (as reasoning-gym builds a task's
scorer): loading and preparing must not count against the per-call timeout."""

import time

SLOW_PREPARE_SECONDS = 1.5


def quick(data_source, solution_str, ground_truth, extra_info):
    return 1.0


def _prepare(data_source):
    time.sleep(SLOW_PREPARE_SECONDS)


quick.prepare = _prepare

"""A reward module that takes SLOW_IMPORT_SECONDS to import (like one pulling in sympy or a
sandbox client): importing and preparing must not count against the per-call timeout."""

import time

SLOW_IMPORT_SECONDS = 1.5
time.sleep(SLOW_IMPORT_SECONDS)


def quick(data_source, solution_str, ground_truth, extra_info):
    return 1.0

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


def copies_the_prompts_digit(data_source, solution_str, ground_truth, extra_info):
    """The toy task scored from the prompt alone (no ground truth), as a user of
    `collect_data(prompts)` writes it: the fraction of the response's words that are the
    prompt's last word."""
    words, target = solution_str.split(), extra_info["prompt"].split()[-1]
    return sum(word == target for word in words) / len(words) if words else 0.0


def tries_to_escape(data_source, solution_str, ground_truth, extra_info):
    """What a reward function steered by the model's text could try; each detail is 1.0 where
    it worked: read the rank's secret, connect to a port on this machine, read a file anyone
    may read (a checkpoint), write outside its own folder."""
    import socket

    escaped = {"secret": float(extra_info["secret"] in os.environ)}
    try:
        with open(extra_info["readable_by_anyone"]) as handle:
            escaped["read"] = float(bool(handle.read()))
    except OSError:
        escaped["read"] = 0.0
    try:
        socket.create_connection(("127.0.0.1", extra_info["port"]), timeout=2).close()
        escaped["network"] = 1.0
    except OSError:
        escaped["network"] = 0.0
    try:
        with open(extra_info["outside"], "w") as handle:
            handle.write("escaped")
        escaped["write"] = 1.0
    except OSError:
        escaped["write"] = 0.0
    return {"score": 0.0, **escaped}


class RunsWhereUnpickled:
    """Unpickling it makes a directory: whoever unpickles it runs code its sender chose."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def forges_its_reply(data_source, solution_str, ground_truth, extra_info):
    """Sends, on its worker's own connection to the rank, a pickle that makes a directory where
    it is unpickled, shaped like a reply."""
    import gc
    import pickle
    from multiprocessing.connection import Connection

    forged = pickle.dumps((True, RunsWhereUnpickled(extra_info["marker"]), ""))
    for connection in [item for item in gc.get_objects() if isinstance(item, Connection)]:
        if not connection.closed:
            connection.send_bytes(forged)
    return 1.0


def reads_a_file(data_source, solution_str, ground_truth, extra_info):
    with open(extra_info["path"]) as handle:
        return float(handle.read())


def reads_a_variable(data_source, solution_str, ground_truth, extra_info):
    return float(os.environ["MCORE_RL_TEST_JUDGE_KEY"])


def allocates(data_source, solution_str, ground_truth, extra_info):
    """Writes a buffer of extra_info["megabytes"] (a large library's import, in effect)."""
    buffer = bytearray(extra_info["megabytes"] << 20)
    return float(len(buffer) > 0)

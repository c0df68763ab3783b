"""Rule rewards: math-verify and reasoning-gym scores against the libraries' own answers, the toy
copy task, the format reward formula, the worker sandbox (raising, hanging, spinning and dying
functions give 0 and a logged error while the pool keeps going), and start-up errors (unknown
data sources, dotted paths that do not import)."""

import dataclasses
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import reasoning_gym
from omegaconf import OmegaConf

import reward_functions
from mcore_rl.config.reward import RewardConfig
from mcore_rl.rewards import (BUILTIN_FUNCTIONS, RewardRequest, RewardResult, RuleRewards,
                              UnknownDataSourceError)
from mcore_rl.rewards.formats import compile_format_pattern, format_score
from mcore_rl.rewards.math_answers import math_score
from mcore_rl.rewards.toy import copy_score

TIMEOUT = 1.0
TEST_FUNCTIONS = {
    "test/raises": "reward_functions:raises",
    "test/sleeps": "reward_functions:sleeps_forever",
    "test/spins": "reward_functions:spins_forever",
    "test/exits": "reward_functions:exits",
    "test/nan": "reward_functions:returns_nan",
    "test/text": "reward_functions:returns_text",
    "test/no_score": "reward_functions:returns_dict_without_score",
    "test/details": "reward_functions:returns_details",
    "test/numpy": "reward_functions:returns_numpy",
    "test/half": "reward_functions.constant_half",  # the "package.module.function" form
    "test/slow_import": "reward_slow_import:quick",
    "test/escape": "reward_functions:tries_to_escape",
    "test/forge": "reward_functions:forges_its_reply",
}
SECRET = "MCORE_RL_TEST_REWARD_SECRET"
"""Set in the rank's environment (as a W&B or HF token is) before the workers start."""


def request(data_source, response, ground_truth=None, extra_info=None, sample_id="s0"):
    return RewardRequest(sample_id=sample_id, data_source=data_source, response=response,
                         ground_truth=ground_truth, extra_info=extra_info or {})


@pytest.fixture(scope="module")
def sandbox():
    """Two long-lived workers shared by the tests below (start-up is paid once), started with
    a secret in the rank's environment."""
    config = RewardConfig(num_workers=2, timeout_seconds=TIMEOUT, functions=TEST_FUNCTIONS)
    os.environ[SECRET] = "hf_not_for_reward_functions"
    try:
        with RuleRewards(config) as rewards:
            yield rewards
    finally:
        del os.environ[SECRET]


@pytest.fixture
def inline():
    with RuleRewards(RewardConfig(num_workers=0, functions=TEST_FUNCTIONS)) as rewards:
        yield rewards


# ---- math (math-verify) ----------------------------------------------------------------------

GSM8K_SOLUTION = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                  "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")

MATH_CASES = [
    # (response, ground truth, expected)
    ("The answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
    ("So we get \\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("So we get \\boxed{0.5}", "\\frac{1}{3}", 0.0),
    ("She sold 72 clips in total.", GSM8K_SOLUTION, 1.0),
    ("She sold 72 clips in total.", "#### 72", 1.0),
    ("She sold \\boxed{71} clips.", "#### 72", 0.0),
    ("\\boxed{1000}", "#### 1,000", 1.0),
    ("<think>48 + 24</think> <answer>72</answer>", "72", 1.0),  # raw math-verify misses this
    ("<think>the answer is 72</think> <answer>70</answer>", "72", 0.0),
    ("\\boxed{x(x+2)}", "x^2+2x", 1.0),
    ("The point is \\boxed{(3,-1)}", "(3, -1)", 1.0),
    ("\\boxed{3} or maybe \\boxed{4}", "4", 0.0),  # hedging with two boxes earns nothing
    ("I do not know", "5", 0.0),
    ("\\boxed{\\frac{1}{3}}", ["0.5", "1/3"], 1.0),  # any of several golds
    ("\\boxed{42}", 42, 1.0),  # numeric ground truth
]


@pytest.mark.parametrize("response, ground_truth, expected", MATH_CASES)
def test_math_score_matches_known_answers(response, ground_truth, expected):
    assert math_score("math", response, ground_truth, {}) == expected


def test_math_data_sources_of_verl_are_built_in(inline):
    names = ["openai/gsm8k", "gsm8k", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval",
             "math"]
    assert set(names) <= set(BUILTIN_FUNCTIONS)
    results = inline.score([request(name, "so \\boxed{72}", "#### 72") for name in names])
    assert [result.score for result in results] == [1.0] * len(names)


def test_math_ground_truth_errors_are_zero_with_error(inline):
    missing, unparsable = inline.score([request("math", "\\boxed{1}", None),
                                        request("math", "\\boxed{1}", "")])
    assert (missing.score, unparsable.score) == (0.0, 0.0)
    assert missing.error.startswith("ValueError: math data sources need a ground_truth")
    assert unparsable.error.startswith("ValueError: ground truth") and "parse" in unparsable.error


# ---- reasoning-gym -----------------------------------------------------------------------------

RG_TASKS = ["chain_sum", "basic_arithmetic", "simple_equations", "gsm_symbolic"]


def rg_entries(task, size=3, seed=7):
    return list(reasoning_gym.create_dataset(task, size=size, seed=seed))


@pytest.mark.parametrize("task", RG_TASKS)
def test_reasoning_gym_scores_equal_the_tasks_own_scorer(sandbox, task):
    score_answer = reasoning_gym.get_score_answer_fn(task)
    requests, expected = [], []
    for index, entry in enumerate(rg_entries(task)):
        # Entries travel through the dataset as JSON (tuples become lists; or the JSON text).
        extra_info = {"reasoning_gym_entry": json.loads(json.dumps(entry))}
        if index == 1:
            extra_info = {"reasoning_gym_entry": json.dumps(entry)}
        answer, wrong = entry["answer"], entry["answer"] + "1"
        responses = {
            f"<think>working</think>\n<answer>{answer}</answer>": answer,
            f"<answer>{wrong}</answer>": wrong,
            f"<answer> 0 </answer> then <answer>{answer}</answer>": answer,  # the last tags
            answer: answer,  # no tags: the whole response
            f"it is {answer}": f"it is {answer}",
        }
        for response, extracted in responses.items():
            requests.append(request(f"reasoning_gym/{task}", response, None, extra_info))
            expected.append(score_answer(extracted, entry))
    results = sandbox.score(requests)
    assert [result.error for result in results] == [None] * len(requests)
    assert [result.score for result in results] == expected
    assert expected[0] == 1.0 and expected[1] < 1.0


def test_reasoning_gym_without_entry_is_an_error(sandbox):
    (result,) = sandbox.score([request("reasoning_gym/chain_sum", "<answer>3</answer>", "3")])
    assert result.score == 0.0 and "reasoning_gym_entry" in result.error


# ---- toy copy and format ---------------------------------------------------------------------

@pytest.mark.parametrize("response, ground_truth, expected", [
    ("7", 7, 1.0), ("7 7 3", "7", 2 / 3), ("3 4", 7, 0.0), ("", 7, 0.0), ("  \n", 7, 0.0),
    ("7.0 7", 7, 0.5), (" 7\t7\n", "7", 1.0),
])
def test_toy_copy_is_the_fraction_of_words_equal_to_the_ground_truth(response, ground_truth,
                                                                     expected):
    assert copy_score("toy/copy", response, ground_truth, {}) == pytest.approx(expected)


def test_format_pattern_accepts_r1_responses_only():
    pattern = compile_format_pattern(RewardConfig().format_pattern)
    assert format_score("<think>\nstep 1\nstep 2\n</think>\n<answer>72</answer>\n", pattern) == 1
    assert format_score("<think>x</think><answer>72</answer>", pattern) == 1
    assert format_score("<answer>72</answer>", pattern) == 0
    assert format_score("<think>x</think> 72", pattern) == 0
    assert format_score("<think>x</think> <answer>72</answer> and more", pattern) == 0
    assert format_score("preamble <think>x</think> <answer>72</answer>", pattern) == 0


def test_format_reward_is_mixed_as_documented():
    weight = 0.2
    config = RewardConfig(num_workers=0, format_weight=weight)
    with RuleRewards(config) as rewards:
        results = rewards.score([
            request("math", "<think>48+24</think> <answer>72</answer>", "72"),
            request("math", "<answer>72</answer>", "72"),
            request("math", "<think>48+24</think> <answer>71</answer>", "72"),
            request("math", "71", "72"),
        ])
    # score = (1 - w) * correctness + w * format
    assert [result.score for result in results] == pytest.approx(
        [1.0, 1 - weight, weight, 0.0])
    assert results[1].details == {"correctness": 1.0, "format": 0.0}
    assert results[2].details == {"correctness": 0.0, "format": 1.0}


# ---- the sandbox -------------------------------------------------------------------------------

def errors_logged_for(caplog, sample_id):
    return [record for record in caplog.records
            if record.name == "mcore_rl.rewards" and record.levelno == logging.ERROR
            and sample_id in record.getMessage()]


def test_a_raising_function_gives_zero_and_a_logged_error(sandbox, caplog):
    caplog.set_level(logging.ERROR, logger="mcore_rl.rewards")
    good, bad = sandbox.score([request("toy/copy", "7", 7, sample_id="step0/ok"),
                               request("test/raises", "x", sample_id="step0/rank1/prompt2")])
    assert good == RewardResult(1.0, None, {})
    assert bad == RewardResult(0.0, "RuntimeError: boom on x", {})
    (record,) = errors_logged_for(caplog, "step0/rank1/prompt2")
    assert "RuntimeError: boom on x" in record.getMessage()
    assert not errors_logged_for(caplog, "step0/ok")


@pytest.mark.parametrize("data_source", ["test/sleeps", "test/spins"])
def test_a_hung_function_times_out_and_its_worker_is_replaced(sandbox, caplog, data_source):
    caplog.set_level(logging.ERROR, logger="mcore_rl.rewards")
    pids_before = sandbox.worker_pids()
    start = time.monotonic()
    results = sandbox.score([request(data_source, "x", sample_id="hung/sample")]
                            + [request("toy/copy", "7 3", 7, sample_id=f"good{i}")
                               for i in range(6)])
    elapsed = time.monotonic() - start
    assert results[0] == RewardResult(
        0.0, f"timeout after {TIMEOUT} s (reward.timeout_seconds bounds each call)", {})
    assert [result.score for result in results[1:]] == [0.5] * 6  # the other worker went on
    assert TIMEOUT <= elapsed < TIMEOUT + 5
    assert len(errors_logged_for(caplog, "hung/sample")) == 1
    assert "timeout" in errors_logged_for(caplog, "hung/sample")[0].getMessage()
    assert sandbox.live_workers() == 2
    assert len(set(sandbox.worker_pids()) - set(pids_before)) == 1
    (after,) = sandbox.score([request("toy/copy", "2", 2, sample_id="after")])
    assert after == RewardResult(1.0, None, {})


def test_two_hung_functions_at_once_leave_a_working_pool(sandbox):
    results = sandbox.score([request("test/sleeps", "x"), request("test/spins", "y"),
                             request("toy/copy", "7", 7)])
    assert [result.score for result in results] == [0.0, 0.0, 1.0]
    assert [result.error for result in results[:2]] == [
        f"timeout after {TIMEOUT} s (reward.timeout_seconds bounds each call)"] * 2
    assert sandbox.live_workers() == 2


def test_a_dying_worker_gives_zero_and_is_replaced(sandbox, caplog):
    caplog.set_level(logging.ERROR, logger="mcore_rl.rewards")
    died, good = sandbox.score([request("test/exits", "x", sample_id="dies"),
                                request("toy/copy", "7", 7)])
    assert died == RewardResult(0.0, "reward worker process died (exit code 3)", {})
    assert good.score == 1.0
    assert errors_logged_for(caplog, "dies")
    assert sandbox.live_workers() == 2


def test_bad_return_values_give_zero_and_say_why(sandbox):
    nan, text, no_score = sandbox.score([request("test/nan", "x"), request("test/text", "x"),
                                         request("test/no_score", "x")])
    assert (nan.score, text.score, no_score.score) == (0.0, 0.0, 0.0)
    assert nan.error == "ValueError: reward function returned a non-finite score nan"
    assert text.error.startswith("TypeError: reward function returned str '1.0'")
    assert no_score.error.startswith("ValueError: reward function returned a dict without")


def test_dict_results_keep_numeric_details_and_run_in_another_process(sandbox):
    (result,) = sandbox.score([request("test/details", "x")])
    assert result.score == 0.25 and result.error is None
    assert set(result.details) == {"acc", "pid"} and result.details["acc"] == 1.0
    assert int(result.details["pid"]) in sandbox.worker_pids()
    assert int(result.details["pid"]) != os.getpid()


def test_numpy_scalars_are_numbers_and_unpicklable_requests_fail_alone(sandbox):
    numpy_result, unpicklable, good = sandbox.score([
        request("test/numpy", "x"), request("toy/copy", "7", 7, {"bad": lambda: None}),
        request("toy/copy", "7", 7)])
    assert numpy_result == RewardResult(0.75, None, {"correct": 1.0})
    assert unpicklable.score == 0.0
    assert unpicklable.error.startswith("request cannot be sent to a reward worker")
    assert good == RewardResult(1.0, None, {})


def test_preparing_a_function_does_not_count_against_the_call_timeout(sandbox):
    from reward_slow_import import SLOW_PREPARE_SECONDS
    assert SLOW_PREPARE_SECONDS > TIMEOUT
    results = sandbox.score([request("test/slow_import", "x"), request("test/half", "x")])
    assert results == [RewardResult(1.0, None, {}), RewardResult(0.5, None, {})]


def test_a_function_slower_to_prepare_than_startup_timeout_gives_zero():
    config = RewardConfig(num_workers=1, timeout_seconds=TIMEOUT, startup_timeout_seconds=0.3,
                          functions={"test/slow_import": "reward_slow_import:quick"})
    with RuleRewards(config) as rewards:
        (result,) = rewards.score([request("test/slow_import", "x")])
        assert result.score == 0.0 and result.error.startswith("timeout after 0.3 s starting")
        assert rewards.live_workers() == 1
    assert rewards.live_workers() == 0


KILLED_PARENT = """
import sys
sys.path.insert(0, {tests!r})
from mcore_rl.config.reward import RewardConfig
from mcore_rl.rewards import RewardRequest, RuleRewards
config = RewardConfig(num_workers=1, timeout_seconds=60,
                      functions={{"spin": "reward_functions:spins_forever"}})
rewards = RuleRewards(config)
print(*rewards.worker_pids(), flush=True)
rewards.score([RewardRequest("s", "spin", "x", None, {{}})])
"""


def test_workers_exit_when_their_parent_is_killed_mid_call():
    script = KILLED_PARENT.format(tests=os.path.dirname(__file__))
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        (worker_pid,) = map(int, parent.stdout.readline().split())
        deadline = time.monotonic() + 30
        while cpu_seconds(worker_pid) < 0.5 and time.monotonic() < deadline:  # it spins
            assert parent.poll() is None, "the parent exited before its worker spun"
            time.sleep(0.1)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while pid_is_running(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_is_running(worker_pid)


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as stat:
        user, system = stat.read().split(")")[-1].split()[11:13]
    return (int(user) + int(system)) / os.sysconf("SC_CLK_TCK")


def pid_is_running(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_reward_functions_see_no_secret_no_network_and_no_file_outside_their_own(
        sandbox, tmp_path):
    folder = tempfile.mkdtemp(prefix="mcore_rl-checkpoints-", dir="/tmp")  # anyone may read
    os.chmod(folder, 0o755)
    checkpoint = os.path.join(folder, "model.pt")
    with open(checkpoint, "w") as handle:
        handle.write("weights")
    os.chmod(checkpoint, 0o644)
    try:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            (result,) = sandbox.score([request("test/escape", "x", extra_info={
                "secret": SECRET, "port": listener.getsockname()[1],
                "readable_by_anyone": checkpoint, "outside": str(tmp_path / "escaped.txt")})])
    finally:
        shutil.rmtree(folder)
    assert result.error is None
    assert result.details == {"secret": 0.0, "network": 0.0, "read": 0.0, "write": 0.0}
    assert not (tmp_path / "escaped.txt").exists()


def test_the_rank_decodes_only_plain_data_from_a_worker(sandbox, tmp_path):
    """A worker's reply is data the rank checks, never an object it unpickles: a forged reply
    ends that worker, and the pool goes on."""
    forged, good = sandbox.score([request("test/forge", "x",
                                          extra_info={"marker": str(tmp_path / "ran")}),
                                  request("toy/copy", "7", 7)])
    assert not (tmp_path / "ran").exists()
    assert forged.score == 0.0 and "is not plain data" in forged.error, forged
    assert good == RewardResult(1.0, None, {})
    assert sandbox.live_workers() == 2


def test_close_stops_the_workers():
    rewards = RuleRewards(RewardConfig(num_workers=2))
    assert rewards.live_workers() == 2
    rewards.close()
    assert rewards.live_workers() == 0
    with pytest.raises(RuntimeError, match="after close"):
        rewards.score([request("toy/copy", "7", 7)])
    rewards.close()  # idempotent


def test_inline_scoring_turns_failures_into_zero_too(inline, caplog):
    caplog.set_level(logging.ERROR, logger="mcore_rl.rewards")
    assert inline.live_workers() == 0
    bad, good = inline.score([request("test/raises", "x", sample_id="inline/bad"),
                              request("test/details", "x")])
    assert bad == RewardResult(0.0, "RuntimeError: boom on x", {})
    assert good.details["pid"] == os.getpid()
    assert errors_logged_for(caplog, "inline/bad")


# ---- start-up errors ---------------------------------------------------------------------------

def test_unknown_data_sources_are_an_error_listing_the_known_ones():
    rewards = RuleRewards(RewardConfig(num_workers=0, functions=TEST_FUNCTIONS))
    rewards.check_data_sources({"openai/gsm8k", "toy/copy", "test/half",
                                "reasoning_gym/chain_sum"})
    with pytest.raises(UnknownDataSourceError) as error:
        rewards.check_data_sources({"openai/gsm8k", "my/dataset", "reasoning_gym/no_such_task"})
    message = str(error.value)
    assert isinstance(error.value, ValueError)
    assert "'my/dataset'" in message and "reasoning-gym has no task 'no_such_task'" in message
    assert "'openai/gsm8k'" in message and "'test/half'" in message and "'toy/copy'" in message
    assert "reasoning_gym/<task>" in message and "reward.functions" in message


def test_scoring_an_unknown_data_source_raises_before_any_call():
    reward_functions.CALLS.clear()
    config = RewardConfig(num_workers=0, functions={"counted": "reward_functions:record_call"})
    rewards = RuleRewards(config)
    with pytest.raises(UnknownDataSourceError, match="'my/dataset'"):
        rewards.score([request("counted", "x"), request("my/dataset", "x")])
    assert reward_functions.CALLS == []
    rewards.score([request("counted", "x")])
    assert reward_functions.CALLS == ["counted"]


def test_default_function_and_overrides_of_built_ins():
    config = RewardConfig(num_workers=0, default_function="reward_functions:constant_half",
                          functions={"toy/copy": "reward_functions:length_of_response"})
    rewards = RuleRewards(config)
    rewards.check_data_sources({"anything/at_all"})
    results = rewards.score([request("anything/at_all", "x"), request("toy/copy", "7 7", 7),
                             request("math", "\\boxed{1}", "1")])
    assert [result.score for result in results] == [0.5, 3.0, 1.0]


@pytest.mark.parametrize("functions, default, expected", [
    ({"my/source": "no_such_module_xyz:score"}, None,
     ["'no_such_module_xyz:score'", "data_source 'my/source'", "ModuleNotFoundError"]),
    ({"my/source": "reward_functions:missing"}, None,
     ["'reward_functions:missing'", "data_source 'my/source'", "AttributeError"]),
    ({"my/source": "reward_functions:NOT_CALLABLE"}, None,
     ["'reward_functions:NOT_CALLABLE'", "not callable"]),
    ({}, "no_such_module_xyz.score", ["'no_such_module_xyz.score'", "reward.default_function"]),
])
def test_dotted_paths_that_do_not_load_fail_at_construction(functions, default, expected):
    config = RewardConfig(num_workers=2, functions=functions, default_function=default)
    with pytest.raises(ValueError) as error:
        RuleRewards(config)
    for text in expected:
        assert text in str(error.value)


def test_user_reward_fn_scores_every_data_source_and_must_be_picklable():
    """A module's function goes by name, a closure by value (cloudpickle, as the script's own
    functions: tests/test_user_code.py); one holding what cannot be pickled is refused at
    construction, naming it."""
    with RuleRewards(RewardConfig(num_workers=1), reward_fn=reward_functions.returns_details) \
            as rewards:
        rewards.check_data_sources({"never/heard/of"})
        (result,) = rewards.score([request("never/heard/of", "x")])
        assert result.score == 0.25 and result.details["pid"] != os.getpid()
    weight = 0.75
    with RuleRewards(RewardConfig(num_workers=1), reward_fn=lambda *args: weight) as rewards:
        assert rewards.score([request("x", "y")])[0] == RewardResult(0.75)
    lock = threading.Lock()
    with pytest.raises(ValueError, match="reward_fn .*<lambda>.* cannot be sent .*lock"):
        RuleRewards(RewardConfig(num_workers=1), reward_fn=lambda *args: lock.locked())
    inline = RuleRewards(RewardConfig(num_workers=0), reward_fn=lambda *args: lock.locked())
    assert inline.score([request("x", "y")])[0].score == 0.0


PROBE_CASES = {  # the function, the reward.* field that allows it, its allowing value
    "a file": ("reward_functions:reads_a_file", "readable", lambda folder: (folder,)),
    "a variable": ("reward_functions:reads_a_variable", "environment",
                   lambda folder: ("MCORE_RL_TEST_JUDGE_KEY",)),
    "memory": ("reward_functions:allocates", "memory_mb", lambda folder: 4096),
}


@pytest.mark.parametrize("case", PROBE_CASES)
def test_the_probe_stops_what_the_sandbox_refuses_and_names_the_setting(case, tmp_path,
                                                                        monkeypatch):
    """A function that reads a file, a variable of the rank's or more memory than the sandbox
    gives fails its probe on a real row, the error naming the reward.* setting; given the
    setting, the same probe passes."""
    function, field, allowing = PROBE_CASES[case]
    (tmp_path / "answer.txt").write_text("0.5")
    monkeypatch.setenv("MCORE_RL_TEST_JUDGE_KEY", "0.5")
    row = request("probe", "7", "7", {"path": str(tmp_path / "answer.txt"), "megabytes": 1024},
                  sample_id="row 3")
    refused = RewardConfig(num_workers=1, memory_mb=768, functions={"probe": function})
    with RuleRewards(refused) as rewards:
        with pytest.raises(ValueError, match=rf"row 3 \(data_source 'probe'\): .*reward\.{field}"):
            rewards.probe([row])
    with RuleRewards(dataclasses.replace(refused, **{field: allowing(str(tmp_path))})) as rewards:
        rewards.probe([row])


def test_the_start_up_probe_runs_aside_and_fails_when_the_rewards_are_taken(tmp_path):
    """The trainer probes its rule rewards in a thread while the rank starts its engine and
    models (rl/build.py's RuleRewardStart): a failure comes out when the rewards are taken,
    naming the row and the rank; a passing probe gives the rewards."""
    from mcore_rl.config import ConfigError
    from mcore_rl.data.records import PromptRecord
    from mcore_rl.rl.build import RuleRewardStart
    from mcore_rl.roles import RuleReward

    config = RewardConfig(num_workers=1, functions={"probe": "reward_functions:reads_a_file"},
                          readable=(str(tmp_path),))
    record = PromptRecord(3, "q", "probe", "7", {"path": str(tmp_path / "answer.txt")})
    with RuleRewards(config) as rewards:
        reward = RuleReward(rewards, tokenizer=None)
        with pytest.raises(ConfigError, match=r"reward: rank 0: .*row 3 \(data_source 'probe'\)"
                                              r".*FileNotFoundError"):
            RuleRewardStart(reward, [record]).result()
        (tmp_path / "answer.txt").write_text("0.5")
        assert RuleRewardStart(reward, [record]).result() is reward


OUTSIDE_THE_REPOSITORY = """
from mcore_rl.config.reward import RewardConfig
from mcore_rl.rewards import RewardRequest, RuleRewards
with RuleRewards(RewardConfig(num_workers=1)) as rewards:
    print(rewards.score([RewardRequest("s", "toy/copy", "7 7", "7", {})])[0])
"""


def test_the_packages_own_rewards_score_from_outside_the_repository(tmp_path):
    """From a folder outside the repository, with the package installed editable (not on
    sys.path): its built-in functions load in the sandbox."""
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", OUTSIDE_THE_REPOSITORY], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "RewardResult(score=1.0, error=None, details={}, correct=None)", \
        done.stdout + done.stderr[-3000:]


# ---- config ----------------------------------------------------------------------------------

def test_config_is_omegaconf_structured_and_validated():
    merged = OmegaConf.merge(OmegaConf.structured(RewardConfig), OmegaConf.create({
        "functions": {"openai/gsm8k": "my_pkg.rewards:gsm8k"}, "timeout_seconds": 3,
        "default_function": "my_pkg.rewards.fallback"}))
    config = OmegaConf.to_object(merged)
    assert config == RewardConfig(functions={"openai/gsm8k": "my_pkg.rewards:gsm8k"},
                                  timeout_seconds=3.0, default_function="my_pkg.rewards.fallback")
    assert config.errors() == []
    bad = RewardConfig(num_workers=-1, timeout_seconds=0, startup_timeout_seconds=-1,
                       functions={"x": "not a path"}, default_function="nodots",
                       format_weight=1.5, format_pattern="(")
    errors = "\n".join(bad.errors())
    for field_name in ("reward.num_workers=-1", "reward.timeout_seconds=0",
                       "reward.startup_timeout_seconds=-1", "reward.functions.x=",
                       "reward.default_function=", "reward.format_weight=1.5",
                       "reward.format_pattern="):
        assert field_name in errors
    with pytest.raises(ValueError, match="reward.format_weight"):
        RuleRewards(RewardConfig(format_weight=2.0))


def test_reward_functions_see_the_prompt_and_user_prompts_become_records(tmp_path):
    """Every reward call gets its prompt as extra_info["prompt"] (a data row's own value wins);
    collect_data's prompts may be texts, chat messages or verl-shaped dicts."""
    from transformers import AutoTokenizer

    from mcore_rl.data import PromptRecord, write_toy_tokenizer
    from mcore_rl.rl.data import as_record
    from mcore_rl.roles import RuleReward
    from mcore_rl.rollout import Completion, Generation

    tokenizer = AutoTokenizer.from_pretrained(write_toy_tokenizer(str(tmp_path / "tokenizer")))
    records = [as_record("copy 7", 0),
               as_record({"prompt": "copy 3", "ground_truth": "3", "data_source": "toy/copy",
                          "extra_info": {"prompt": "the row's own"}}, 1)]
    assert records[0] == PromptRecord(index=0, prompt="copy 7", data_source="custom",
                                      ground_truth=None, extra_info={})
    assert records[1].ground_truth == "3" and records[1].data_source == "toy/copy"
    with pytest.raises(ValueError, match="prompt 2: a dict needs 'prompt' and may have"):
        as_record({"question": "copy 1"}, 2)
    seven = tokenizer.convert_tokens_to_ids("7")
    generation = Generation([Completion(0, 0, [seven], [-0.1], "stop"),
                             Completion(1, 0, [seven], [-0.1], "stop")],
                            [[1], [1]], {})
    with RuleRewards(RewardConfig(num_workers=0),
                     reward_fn=reward_functions.copies_the_prompts_digit) as rewards:
        results = RuleReward(rewards, tokenizer).score(generation, records, "test")
    assert [result.score for result in results] == [1.0, 0.0]  # "the row's own" ends in "own"

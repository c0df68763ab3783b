"""The reward-hacking warning (evaluation/reward_hacking.py) on evaluation series measured on
this project's runs: it fires on SFT -> RM -> PPO as issue 31 found it (the reward model's
score rising while the checked accuracy falls, one answer for every question, KL 5.5), and stays
quiet on a healthy GRPO run (the quickstart, 24 steps: accuracy up, distinct_1 at 0.21 of its
start, KL 1.05). An accuracy rising with the reward clears the other signs only beside a reward
model's score: a rule reward's accuracy is its own check (issue 63)."""

import pytest

from mcore_rl.config.trainer import RewardHackingConfig
from mcore_rl.evaluation.reward_hacking import RewardHackingMonitor

HACKED = [  # eval rows of the PPO run against a reward model (issue 31; accuracy checked)
    {"eval/rm_score_mean": -0.93, "eval/accuracy": 0.505, "eval/distinct_1": 0.027,
     "eval/kl_to_reference": 0.0},
    {"eval/rm_score_mean": 1.2, "eval/accuracy": 0.49, "eval/distinct_1": 0.02,
     "eval/kl_to_reference": 0.8},
    {"eval/rm_score_mean": 3.88, "eval/accuracy": 0.305, "eval/distinct_1": 0.0025,
     "eval/kl_to_reference": 5.5},
]
HEALTHY = [  # the quickstart's GRPO, bench/chaos.py's uninterrupted colocated run
    {"eval/reward_mean": 0.075, "eval/accuracy": 0.07, "eval/distinct_1": 0.0351,
     "eval/kl_to_reference": 0.0},
    {"eval/reward_mean": 0.53, "eval/accuracy": 0.53, "eval/distinct_1": 0.01,
     "eval/kl_to_reference": 0.4256},
    {"eval/reward_mean": 0.7, "eval/accuracy": 0.695, "eval/distinct_1": 0.0075,
     "eval/kl_to_reference": 1.0524},
]


def run(rows, config=RewardHackingConfig(), **kl):
    monitor = RewardHackingMonitor(config)
    return [monitor.check(row, **kl) for row in rows]


def test_a_hacked_run_warns_with_every_sign_and_a_healthy_one_does_not():
    first, slightly, hacked = run(HACKED)
    assert first == ({}, None)  # the start: nothing to compare with
    assert slightly == ({"warnings/accuracy_down": 0.0, "warnings/diversity_collapse": 0.0,
                         "warnings/kl_exceeded": 0.0, "warnings/reward_hacking": 0.0}, None)
    logged, message = hacked
    assert logged == {"warnings/accuracy_down": 1.0, "warnings/diversity_collapse": 1.0,
                      "warnings/kl_exceeded": 1.0, "warnings/reward_hacking": 1.0}
    assert "eval/rm_score_mean rose -0.93 -> 3.88" in message
    assert "eval/accuracy fell 0.505 -> 0.305" in message
    assert "distinct_1 fell to 9% of its start" in message and "5.5 > 3" in message
    for logged, message in run(HEALTHY)[1:]:
        assert message is None and logged["warnings/reward_hacking"] == 0.0, logged


@pytest.mark.parametrize("sign, row", [
    ("accuracy_down", {"eval/accuracy": 0.44}),
    ("diversity_collapse", {"eval/distinct_1": 0.0026}),
    ("kl_exceeded", {"eval/kl_to_reference": 3.1}),
])
def test_each_sign_alone_warns_only_while_the_reward_rises(sign, row):
    start = {"eval/rm_score_mean": 0.0, "eval/accuracy": 0.5, "eval/distinct_1": 0.027,
             "eval/kl_to_reference": 0.0}
    calm = {"eval/rm_score_mean": 1.0, "eval/accuracy": 0.46, "eval/distinct_1": 0.0028,
            "eval/kl_to_reference": 2.9}
    _, (logged, message) = run([start, {**calm, **row}])
    assert [name for name, value in logged.items() if value] == [f"warnings/{sign}",
                                                                  "warnings/reward_hacking"]
    assert message is not None
    _, (logged, message) = run([start, {**calm, **row, "eval/rm_score_mean": -1.0}])
    assert logged[f"warnings/{sign}"] == 1.0 and logged["warnings/reward_hacking"] == 0.0
    assert message is None  # a falling reward is failing training, not hacking


def test_the_steps_kl_stands_in_and_the_start_survives_a_resume():
    without_eval_kl = [{k: v for k, v in row.items() if k != "eval/kl_to_reference"}
                       for row in HACKED]
    assert run(without_eval_kl, kl=5.5)[2][0]["warnings/kl_exceeded"] == 1.0
    assert run(without_eval_kl, kl=None)[2][0]["warnings/kl_exceeded"] == 0.0
    monitor = RewardHackingMonitor(RewardHackingConfig())
    monitor.check(HACKED[0])
    resumed = RewardHackingMonitor(RewardHackingConfig())
    resumed.load_state_dict(monitor.state_dict())
    assert resumed.check(HACKED[2]) == monitor.check(HACKED[2])


def test_a_large_kl_with_an_independent_accuracy_rising_is_no_hacking():
    """The quickstart's 60 steps (issue 44): the checked accuracy rose with the reward, KL 3.3
    > 3. Beside a reward model's score the accuracy is an independent check: the KL is logged,
    not warned of; with the accuracy flat it warns."""
    start = {"eval/rm_score_mean": 0.51, "eval/accuracy": 0.505, "eval/distinct_1": 0.03,
             "eval/kl_to_reference": 0.0}
    learned = {"eval/rm_score_mean": 0.9025, "eval/accuracy": 0.895, "eval/distinct_1": 0.02,
               "eval/kl_to_reference": 3.295}
    _, (logged, message) = run([start, learned])
    assert logged["warnings/kl_exceeded"] == 1.0 and logged["warnings/reward_hacking"] == 0.0
    assert message is None
    _, (logged, message) = run([start, {**learned, "eval/accuracy": 0.52}])
    assert logged["warnings/reward_hacking"] == 1.0 and "KL to the reference 3.295" in message


@pytest.mark.parametrize("sign, row", [
    ("diversity_collapse", {"eval/distinct_1": 0.002}),
    ("kl_exceeded", {"eval/kl_to_reference": 3.295}),
])
def test_a_rule_rewards_own_accuracy_rising_with_it_does_not_clear_a_sign(sign, row):
    """Issue 63: with rule rewards eval/accuracy is the reward's own check thresholded, so an
    exploit of the rule raises both; their rising together must not silence the signs. The
    same series scored by a reward model (the rules then an independent check) stays quiet."""
    start = {"eval/reward_mean": 0.51, "eval/accuracy": 0.505, "eval/distinct_1": 0.03,
             "eval/kl_to_reference": 0.0}
    exploited = {"eval/reward_mean": 0.9025, "eval/accuracy": 0.895, "eval/distinct_1": 0.02,
                 "eval/kl_to_reference": 1.0, **row}
    _, (logged, message) = run([start, exploited])
    assert [name for name, value in logged.items() if value] == [f"warnings/{sign}",
                                                                  "warnings/reward_hacking"]
    assert message is not None and "eval/reward_mean rose 0.51 -> 0.9025" in message
    assert "eval/accuracy rose too (0.505 -> 0.895), but it is the same rule check" in message
    scored = [{("eval/rm_score_mean" if key == "eval/reward_mean" else key): value
               for key, value in each.items()} for each in (start, exploited)]
    _, (logged, message) = run(scored)
    assert logged[f"warnings/{sign}"] == 1.0 and logged["warnings/reward_hacking"] == 0.0
    assert message is None


def test_thresholds_are_options():
    strict = RewardHackingConfig(kl_bound=0.5)
    assert run(HACKED[:2], strict)[1][0]["warnings/reward_hacking"] == 1.0  # KL 0.8 > 0.5
    assert run(HACKED[:2])[1][0]["warnings/reward_hacking"] == 0.0
    assert RewardHackingConfig(distinct_fraction=2, kl_bound=0).errors() == [
        "trainer.reward_hacking.distinct_fraction=2 must be in [0, 1]",
        "trainer.reward_hacking.kl_bound=0 must be positive"]

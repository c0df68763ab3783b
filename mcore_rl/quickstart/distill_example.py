"""The on-policy distillation example (scripts/distill_example.sh): the quickstart's SFT model
as the student, distilled without a reward from two teachers, the quickstart's GRPO model (the
student's size) and a wider, deeper model trained the same way; the report compares the
student's held-out accuracy before and after with its teachers' and with GRPO's own run.

    <dir>/wide/hf_init    the wider tiny Llama (hidden 256, 3 layers), the quickstart's tokenizer
    <dir>/wide/...        its conversion, SFT and GRPO runs, as for the quickstart's model
    <dir>/distill         the student distilled from the quickstart's GRPO model
    <dir>/distill_wide    the student distilled from the wide teacher (TP2 beside a PP2 student)
"""

from __future__ import annotations

from pathlib import Path

from .files import HELD_OUT_QUESTIONS, SEED
from .task import VOCABULARY
from .tiny_model import write_tiny_llama

WIDE_HIDDEN, WIDE_LAYERS = 256, 3
GAP_CLOSED = 0.9
"""The report's milestone: the step at which a student has closed this share of the gap
between its starting accuracy and its teacher's."""


def prepare_wide_teacher(directory: str) -> None:
    """The wide teacher's starting HF model (skipped when there): same tokenizer, wider and
    deeper than the quickstart's."""
    folder = Path(directory) / "wide" / "hf_init"
    if folder.is_dir():
        print(f"prepare-wide-teacher: {folder} exists, keeping it")
        return
    write_tiny_llama(str(folder), VOCABULARY, SEED + 1, hidden_size=WIDE_HIDDEN,
                     num_layers=WIDE_LAYERS)
    print(f"prepare-wide-teacher: a tiny Llama of hidden {WIDE_HIDDEN} and {WIDE_LAYERS} layers "
          f"in {folder}")


def distill_report(directory: str) -> str:
    """Held-out accuracy of the student before and after distillation from each teacher,
    against the teacher's and against GRPO's run from the same student: the steps and seconds
    each took to close GAP_CLOSED of the gap."""
    from mcore_rl.observability import load_run

    root = Path(directory)
    grpo = _Curve(load_run(root / "grpo"))
    lines = [f"held-out accuracy ({HELD_OUT_QUESTIONS} questions never trained on, greedy):",
             f"  the student (SFT, step 0): {grpo.accuracy[0]:.1%}"]
    pairs = (("the quickstart's GRPO model (the student's size)", root / "grpo",
              root / "distill"),
             (f"a wider model (hidden {WIDE_HIDDEN}, {WIDE_LAYERS} layers) trained the same way",
              root / "wide" / "grpo", root / "distill_wide"))
    for name, teacher_dir, student_dir in pairs:
        if not (student_dir / "metrics.jsonl").is_file():
            continue
        teacher, student = _Curve(load_run(teacher_dir)), _Curve(load_run(student_dir))
        before, target = student.accuracy[0], teacher.accuracy[-1]
        closed = (student.accuracy[-1] - before) / (target - before) if target > before else 0
        lines += ["", f"teacher: {name}: {target:.1%}",
                  f"  student distilled from it without a reward (step {student.steps[-1]}): "
                  f"{student.accuracy[-1]:.1%} ({closed:.0%} of the gap closed; reverse KL to "
                  f"the teacher {student.first('distill/reverse_kl'):.3g} -> "
                  f"{student.last('distill/reverse_kl'):.3g} per token)",
                  f"  to close {GAP_CLOSED:.0%} of the gap ({_milestone(before, target):.1%}): "
                  f"distillation {student.reaching(_milestone(before, target))}, GRPO from the "
                  f"student {grpo.reaching(_milestone(before, target))}"]
    return "\n".join(lines)


def _milestone(before: float, target: float) -> float:
    return before + GAP_CLOSED * (target - before)


class _Curve:
    """A run's held-out accuracy by evaluated step, and its training seconds up to each step."""

    def __init__(self, run):
        self.run = run
        self.steps, self.accuracy = run.series("eval/accuracy")
        steps, seconds = run.series("time/step")
        self.seconds_until = {0: 0.0}
        total = 0.0
        for step, spent in zip(steps, seconds):
            total += spent
            self.seconds_until[step] = total

    def reaching(self, accuracy: float) -> str:
        """When the run first evaluated at `accuracy` or above: its step and step seconds."""
        for step, value in zip(self.steps, self.accuracy):
            if value >= accuracy:
                return f"step {step} ({self.seconds_until[step]:.1f} s of steps)"
        return f"not within its {self.steps[-1]} steps"

    def first(self, name: str) -> float:
        return self.run.series(name)[1][0]

    def last(self, name: str) -> float:
        return self.run.series(name)[1][-1]

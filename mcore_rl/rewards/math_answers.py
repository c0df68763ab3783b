"""Math answers checked with HF's math-verify: both sides are parsed to SymPy (LaTeX or plain
expressions) and compared symbolically, so "\\frac{1}{2}", "0.5" and "1/2" are the same answer.

The response's answer is the content of its last <answer>...</answer> tags when it has them
(R1-style prompts), else the whole response; math-verify then prefers the \\boxed{} content and
falls back to the last expression. Several \\boxed{} answers parse as a set, which matches only a
set-valued gold (hedging earns nothing).

The gold is the dataset's ground_truth: a bare answer ("72", "\\frac{1}{2}"), LaTeX with $ or
\\boxed{}, or a GSM8K solution ending in "#### 72" (the part after the last #### counts); a list
of golds means any of them is accepted. A gold that does not parse is an error (bad data), not a
silent 0.
"""

from __future__ import annotations

import re
import threading
from typing import Any

# Imported here, not per call: workers load this module before the call's timeout starts.
from math_verify import parse, verify

# math-verify bounds its own parsing and comparison with signal.alarm (seconds), which works in
# the main thread only; elsewhere (inline scoring from a thread) the sandbox timeout is the bound.
MATH_VERIFY_TIMEOUT_SECONDS = 5
ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def math_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict) -> float:
    """1.0 when the response's answer equals the gold (math-verify), else 0.0."""
    timeout = _signal_timeout()
    golds = [_parse_gold(text, timeout) for text in gold_texts(ground_truth)]
    answer = parse(answer_text(solution_str), parsing_timeout=timeout)
    if not answer:
        return 0.0
    return float(any(verify(gold, answer, timeout_seconds=timeout) for gold in golds))


def gold_texts(ground_truth: Any) -> list[str]:
    """The gold answers as LaTeX math-verify can parse (GSM8K "#### 72" reduced to "72")."""
    if ground_truth is None or ground_truth == []:
        raise ValueError("math data sources need a ground_truth (the reference answer)")
    golds = ground_truth if isinstance(ground_truth, (list, tuple)) else [ground_truth]
    return [_as_latex(str(gold)) for gold in golds]


def answer_text(response: str) -> str:
    """The content of the last <answer>...</answer> tags, or the whole response."""
    answers = ANSWER_TAG.findall(response)
    return answers[-1].strip() if answers else response


def _as_latex(gold: str) -> str:
    if "####" in gold:
        gold = gold.rsplit("####", 1)[1]
    gold = gold.strip()
    if "\\boxed" in gold or "$" in gold:
        return gold
    return "\\boxed{" + gold + "}"


def _parse_gold(text: str, timeout: int | None) -> list:
    gold = parse(text, parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"ground truth {text!r} does not parse as math")
    return gold


def _signal_timeout() -> int | None:
    on_main_thread = threading.current_thread() is threading.main_thread()
    return MATH_VERIFY_TIMEOUT_SECONDS if on_main_thread else None

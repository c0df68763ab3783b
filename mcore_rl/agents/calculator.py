"""A calculator tool: `rollout.multi_turn.tools: ["mcore_rl.agents.calculator:calculator"]`.

The expression is what a model wrote, so it is parsed, never handed to eval(): only numbers,
parentheses, unary signs and + - * / // % ** are read, and an operation whose result would
be huge (a power tower, a million-digit product) is refused before it is computed. Every
refusal is a ValueError whose message the model reads as the tool's error (it runs in the
episode's sandbox like any tool, with its time and memory limits behind this).
"""

from __future__ import annotations

import ast
import math
import operator

MAX_EXPRESSION_CHARS = 256
MAX_RESULT_DIGITS = 100
MAX_EXPONENT = 64

BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
          ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
          ast.Pow: operator.pow}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "12 + 7 * (3 - 5)".
    """
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a string, not {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    return _format(_evaluate(tree.body))


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        _check_size(node.op, left, right)
        try:
            return BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("the result is too large") from None
    raise ValueError(f"unsupported in an arithmetic expression: {ast.unparse(node)!r}")


def _check_size(operation: ast.operator, left: int | float, right: int | float) -> None:
    """Refuses a product or power whose result would exceed MAX_RESULT_DIGITS (sums cannot
    outgrow the 256-character input by much)."""
    if isinstance(operation, ast.Pow):
        if abs(right) > MAX_EXPONENT or _digits(left) * abs(right) > MAX_RESULT_DIGITS:
            raise ValueError(f"the power would have more than {MAX_RESULT_DIGITS} digits")
    elif isinstance(operation, ast.Mult) and _digits(left) + _digits(right) > MAX_RESULT_DIGITS:
        raise ValueError(f"the product would have more than {MAX_RESULT_DIGITS} digits")


def _digits(value: int | float) -> float:
    return math.log10(abs(value) + 1) + 1


def _format(value: int | float) -> str:
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("the result is not a finite number")
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return repr(value)
    return str(value)

"""A safe integer calculator: the `calc` tool's whole implementation.

Model text is never given to `eval`/`exec`. The expression is parsed with
``ast.parse(mode="eval")`` and walked by hand; only int literals, unary minus and the binary
operators + - * (and // when enabled) are evaluated, and everything else is a `ToolError`
whose short message the model sees. Length and operand caps bound the work, and a cap on
binary operations per call (default 1) makes multi-step problems need several calls, which
is what makes the environment multi-turn (in the spirit of ToRL).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from steprl.envs.base import ToolError


@dataclass(frozen=True)
class CalcLimits:
    """What one `calc` call may do.

    `max_abs_operand` bounds every literal (and every intermediate and final value), so a
    result can always be passed back to the next call; `max_chars` bounds the text parsed.
    """

    max_ops_per_call: int = 1
    max_abs_operand: int = 10**6
    max_chars: int = 64
    allow_floordiv: bool = False

    def __post_init__(self) -> None:
        if self.max_ops_per_call < 1 or self.max_abs_operand < 1 or self.max_chars < 1:
            raise ValueError(f"CalcLimits fields must be >= 1, got {self}.")


_SYMBOLS: dict[type[ast.operator], str] = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.FloorDiv: "//"}


def evaluate(expression: str, limits: CalcLimits | None = None) -> int:
    """The value of `expression`; raises `ToolError` (short message) for anything not allowed."""
    limits = limits if limits is not None else CalcLimits()
    if not isinstance(expression, str):
        raise ToolError("expression must be text")
    text = expression.strip()
    if not text:
        raise ToolError("empty expression")
    if len(text) > limits.max_chars:
        raise ToolError(f"expression too long (max {limits.max_chars} chars)")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ToolError("syntax error") from None
    ops = _count_ops(tree.body)
    if ops > limits.max_ops_per_call:
        raise ToolError(
            "one operation per call"
            if limits.max_ops_per_call == 1
            else f"at most {limits.max_ops_per_call} operations per call"
        )
    return _eval(tree.body, limits)


def _count_ops(node: ast.AST) -> int:
    if isinstance(node, ast.BinOp):
        return 1 + _count_ops(node.left) + _count_ops(node.right)
    if isinstance(node, ast.UnaryOp):
        return _count_ops(node.operand)
    return 0


def _eval(node: ast.AST, limits: CalcLimits) -> int:
    if isinstance(node, ast.Constant):
        if type(node.value) is not int:  # rejects bool (an int subclass), float, str, ...
            raise ToolError("only integers")
        return _checked(node.value, limits)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return _checked(-_eval(node.operand, limits), limits)
    if isinstance(node, ast.BinOp) and type(node.op) in _SYMBOLS:
        if isinstance(node.op, ast.FloorDiv) and not limits.allow_floordiv:
            raise ToolError("// is not allowed")
        left, right = _eval(node.left, limits), _eval(node.right, limits)
        if isinstance(node.op, ast.Add):
            return _checked(left + right, limits)
        if isinstance(node.op, ast.Sub):
            return _checked(left - right, limits)
        if isinstance(node.op, ast.Mult):
            return _checked(left * right, limits)
        if right == 0:
            raise ToolError("division by zero")
        return _checked(left // right, limits)
    raise ToolError("only + - * // on integers" if limits.allow_floordiv else "only + - * on integers")


def _checked(value: int, limits: CalcLimits) -> int:
    if abs(value) > limits.max_abs_operand:
        raise ToolError(f"number too large (max {limits.max_abs_operand})")
    return value

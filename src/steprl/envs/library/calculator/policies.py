"""Scripted calculator policies: `expert`, `guess`, `random` (see `STRATEGIES`).

Action texts are the canonical strings a tiny char-level model is fine-tuned on, exactly:
``<calc>3+4</calc>`` and ``<answer>35</answer>`` (no spaces, no newline).
"""

from __future__ import annotations

import ast
import functools
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from steprl.envs.policy import Policy
from steprl.types import Task

_RESULT = re.compile(r"<result>(-?\d+)</result>")
_SYMBOLS: dict[type[ast.operator], str] = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.FloorDiv: "//"}


@dataclass(frozen=True)
class _Ref:
    """The result of plan step `index` (read back from that call's observation)."""

    index: int


_Operand = int | _Ref


@functools.lru_cache(maxsize=4096)
def plan(expression: str) -> tuple[tuple[tuple[_Operand, str, _Operand], ...], _Operand]:
    """The minimal call sequence for `expression`, innermost-left first, and the final operand.

    ``(a+b)*(c-d)`` -> steps ``a+b``, ``c-d``, ``#0*#1`` and final ``#2`` (post-order).
    """
    steps: list[tuple[_Operand, str, _Operand]] = []

    def visit(node: ast.AST) -> _Operand:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            inner = visit(node.operand)
            if isinstance(inner, int):
                return -inner
        if isinstance(node, ast.BinOp) and type(node.op) in _SYMBOLS:
            left, right = visit(node.left), visit(node.right)
            steps.append((left, _SYMBOLS[type(node.op)], right))
            return _Ref(len(steps) - 1)
        raise ValueError(f"the calculator expert cannot plan {expression!r}: not + - * on integers.")

    final = visit(ast.parse(expression, mode="eval").body)
    return tuple(steps), final


def expert(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    """Solve with the minimal number of calls, reading each result back from the observations."""
    steps, final = plan(task.prompt)
    results = [int(m.group(1)) for _, obs in history if (m := _RESULT.fullmatch(obs.strip()))]

    def value(operand: _Operand) -> int:
        return results[operand.index] if isinstance(operand, _Ref) else operand

    if len(results) < len(steps):
        left, symbol, right = steps[len(results)]
        return f"<calc>{value(left)}{symbol}{value(right)}</calc>"
    return f"<answer>{value(final)}</answer>"


def guess(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    """Answer at once, with no call: a random integer in the range of typical answers."""
    largest = max((int(x) for x in re.findall(r"\d+", task.prompt)), default=10)
    return f"<answer>{rng.randint(-largest, largest * largest)}</answer>"


_JUNK = '0123456789+-*/() <>acltrswenu{}":,'


def random_policy(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    """Random junk, random tags, random (sometimes valid) calls and answers."""

    def junk() -> str:
        return "".join(rng.choice(_JUNK) for _ in range(rng.randint(0, 16)))

    def call() -> str:
        return f"{rng.randint(-30, 30)}{rng.choice('+-*')}{rng.randint(-30, 30)}"

    options = (
        junk,
        lambda: f"<calc>{junk()}</calc>",
        lambda: f"<calc>{call()}</calc>",
        lambda: f"<answer>{rng.randint(-50, 400)}</answer>",
        lambda: f"<answer>{junk()}</answer>",
        lambda: f"<calc>{junk()}",
        lambda: f'<tool_call>{{"name": "calc", "arguments": {{"expression": "{call()}"}}}}</tool_call>',
        lambda: f"<tool_call>{junk()}</tool_call>",
    )
    return rng.choice(options)()


STRATEGIES: Mapping[str, Policy] = {"expert": expert, "guess": guess, "random": random_policy}

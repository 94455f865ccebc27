"""`CalculatorEnv`: multi-turn arithmetic with one `calc` tool (the default environment).

The policy sees a bare expression such as ``(3+4)*5``, calls ``<calc>3+4</calc>`` (one
operation per call by default), reads ``<result>7</result>``, and so on until it answers
``<answer>35</answer>``. The JSON style (``<tool_call>{...}</tool_call>``) is accepted too.
Reward: outcome 1 for the exact integer, plus the format / cost terms of `RewardConfig`.
"""

from __future__ import annotations

import re

from steprl.envs.library.calculator.evaluate import CalcLimits, evaluate
from steprl.envs.rewards import RewardConfig
from steprl.envs.tool_env import FunctionTool, ToolEnv
from steprl.types import Task

FORMAT_HINT = "use <calc>a+b</calc> or <answer>n</answer>"
_INTEGER = re.compile(r"-?[0-9]+")


def system_prompt(limits: CalcLimits) -> str:
    """The protocol in three sentences (short: a tiny model may be conditioned on it)."""
    ops = "+ - * //" if limits.allow_floordiv else "+ - *"
    n = limits.max_ops_per_call
    per_call = "one operation per call" if n == 1 else f"up to {n} operations per call"
    return (
        f"Compute the expression. Call the calculator with <calc>a+b</calc> (integers, {ops}, "
        f"{per_call}); it replies <result>n</result>. Finish with <answer>n</answer>."
    )


SYSTEM_PROMPT = system_prompt(CalcLimits())


def canonical_integer(text: str) -> str | None:
    """The decimal digits of `text` as `str(int(text))` would give them, or None if `text` is
    not ``-?[0-9]+``. Never calls `int` on model text: a 4301-digit answer would raise
    ``ValueError: Exceeds the limit (4300 digits) for integer string conversion``."""
    if not _INTEGER.fullmatch(text):
        return None
    negative, digits = text.startswith("-"), text.lstrip("-").lstrip("0")
    return f"-{digits}" if negative and digits else digits or "0"


def verify(answer: str, task: Task) -> float:
    """1.0 for the exact integer (after strip), else 0.0; plain ASCII digits only, any length."""
    if task.answer is None:
        return 0.0
    given = canonical_integer(answer.strip())
    return 1.0 if given is not None and given == str(int(task.answer)) else 0.0


def calc_tool(limits: CalcLimits | None = None) -> FunctionTool:
    """The `calc` tool: one string argument `expression`, evaluated safely (`evaluate.py`)."""
    limits = limits if limits is not None else CalcLimits()

    def calc(expression: str) -> str:
        return str(evaluate(expression, limits))

    return FunctionTool(
        name="calc",
        description="evaluate one integer operation, e.g. 3+4 (+ - * only)",
        parameters={
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 3+4"}},
            "required": ["expression"],
            "additionalProperties": False,
        },
        fn=calc,
    )


class CalculatorEnv(ToolEnv):
    """A `ToolEnv` with the `calc` tool (tag name `calc`, argument `expression`)."""

    def __init__(
        self,
        *,
        max_ops_per_call: int = 1,
        max_abs_operand: int = 10**6,
        allow_floordiv: bool = False,
        max_invalid_actions: int = 3,
        format_penalty: float = -0.1,
        tool_call_cost: float = 0.0,
        turn_cost: float = 0.0,
    ) -> None:
        limits = CalcLimits(
            max_ops_per_call=max_ops_per_call, max_abs_operand=max_abs_operand, allow_floordiv=allow_floordiv
        )
        super().__init__(
            [calc_tool(limits)],
            verify,
            system_prompt=system_prompt(limits),
            rewards=RewardConfig(
                format_penalty=format_penalty, tool_call_cost=tool_call_cost, turn_cost=turn_cost
            ),
            max_invalid_actions=max_invalid_actions,
            tag_tools={"calc": "expression"},
            format_hint=FORMAT_HINT,
        )
        self.limits = limits

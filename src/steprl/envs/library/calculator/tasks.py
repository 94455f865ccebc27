"""Deterministic arithmetic tasks whose solution needs 1 to 3 `calc` calls.

Templates by number of calls (ops from + - *, operands 1..max_operand):

    1: a op b        2: (a op b) op c  or  a op (b op c)        3: (a op b) op (c op d)

The prompt is the bare expression (``(3+4)*5``, no spaces) and the answer its integer value.
Each expression belongs to exactly one split, decided by a stable hash of its text (about 20%
go to "eval"), so train and eval are disjoint whatever the seed. The stream is a pure function
of (split, seed, parameters): it uses its own `random.Random(seed)`, never the global RNG.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import random
from collections.abc import Callable, Iterator
from typing import Any, Literal

from steprl.envs.base import ToolError
from steprl.envs.library.calculator.evaluate import CalcLimits, evaluate
from steprl.types import Task

Split = Literal["train", "eval"]
ENV_NAME = "calculator"
OPS = "+-*"
_MAX_REJECTIONS = 100_000  # consecutive draws outside the split before giving up


def split_of(expression: str) -> Split:
    """The split an expression belongs to: sha256(text) mod 5 == 0 -> "eval" (stable across runs)."""
    digest = hashlib.sha256(expression.encode("utf-8")).digest()
    return "eval" if int.from_bytes(digest[:8], "big") % 5 == 0 else "train"


def draw_expression(rng: random.Random, calls: int, max_operand: int) -> str:
    """One expression needing `calls` binary operations (see the module docstring)."""

    def num() -> int:
        return rng.randint(1, max_operand)

    def op() -> str:
        return rng.choice(OPS)

    if calls == 1:
        return f"{num()}{op()}{num()}"
    if calls == 2:
        if rng.random() < 0.5:
            return f"({num()}{op()}{num()}){op()}{num()}"
        return f"{num()}{op()}({num()}{op()}{num()})"
    if calls == 3:
        return f"({num()}{op()}{num()}){op()}({num()}{op()}{num()})"
    raise ValueError(f"calls must be 1, 2 or 3, got {calls}.")


def make_tasks(
    split: str,
    seed: int,
    n: int | None = None,
    *,
    min_calls: int = 1,
    max_calls: int = 3,
    max_operand: int = 20,
    max_abs_value: int = 10**6,
) -> Iterator[Task]:
    """`n` tasks of `split` (infinitely many when `n` is None), the same ones for the same seed.

    The number of calls is drawn uniformly from [min_calls, max_calls]. Expressions with an
    intermediate value above `max_abs_value` (the calculator's operand cap) are redrawn, so
    every task is solvable by chaining `calc` calls.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}.")
    if not 1 <= min_calls <= max_calls <= 3:
        raise ValueError(
            f"need 1 <= min_calls <= max_calls <= 3, got min_calls={min_calls}, max_calls={max_calls}."
        )
    if max_operand < 1:
        raise ValueError(f"max_operand must be >= 1, got {max_operand}.")
    if n is not None and n < 0:
        raise ValueError(f"n must be >= 0 or None, got {n}.")
    limits = CalcLimits(max_ops_per_call=3, max_abs_operand=max_abs_value, max_chars=10**4)
    return _stream(split, seed, n, min_calls, max_calls, max_operand, limits)


def _stream(
    split: str,
    seed: int,
    n: int | None,
    min_calls: int,
    max_calls: int,
    max_operand: int,
    limits: CalcLimits,
) -> Iterator[Task]:
    rng = random.Random(seed)
    index = 0
    rejected = 0
    while n is None or index < n:
        calls = rng.randint(min_calls, max_calls)
        expression = draw_expression(rng, calls, max_operand)
        try:
            value = evaluate(expression, limits) if split_of(expression) == split else None
        except ToolError:
            value = None
        if value is None:
            rejected += 1
            if rejected > _MAX_REJECTIONS:
                raise RuntimeError(
                    f"no {split!r} expression found in {_MAX_REJECTIONS} draws; the expression space "
                    f"is too small (max_operand={max_operand}) or max_abs_value is too low."
                )
            continue
        rejected = 0
        yield Task(
            id=f"{ENV_NAME}-{split}-{seed}-{index}",
            prompt=expression,
            env=ENV_NAME,
            seed=(seed * 1_000_003 + index) % 2**31,
            answer=str(value),
            params={"num_calls": calls},
        )
        index += 1


def renamed_tasks(env: str) -> Callable[..., Iterator[Task]]:
    """The calculator's task generator, its tasks named for `env` (`Task.env`): for envs built
    on the calculator (`calculator_slow`, `calculator_flat`, ...). Its signature is
    `make_tasks`'s (`functools.wraps`: what checks `env.params` reads)."""

    @functools.wraps(make_tasks)
    def tasks(*args: Any, **params: Any) -> Iterator[Task]:
        for task in make_tasks(*args, **params):
            yield dataclasses.replace(task, env=env)

    return tasks

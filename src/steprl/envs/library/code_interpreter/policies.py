"""Scripted strategies for the code-interpreter env: (task, history, rng) -> next action text."""

from __future__ import annotations

import random
from collections.abc import Sequence

from steprl.envs.library.code_interpreter.protocol import OUTPUT_MARKER
from steprl.types import Task


def _last_output(history: Sequence[tuple[str, str]]) -> str:
    return history[-1][1].strip().removesuffix("```").strip() if history else ""


def expert(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    """Run the reference program once, then answer with what it printed."""
    if not history:
        return f"```python\n{task.params['program']}\n```\n{OUTPUT_MARKER}"
    return f"<answer>{_last_output(history)}</answer>"


def guess(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    """No code: answer a plausible number straight away (usually wrong)."""
    return f"<answer>{rng.randint(0, 300)}</answer>"


def buggy(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    """Code with an undefined name, then a guess: exercises the error path."""
    if not history:
        return f"```python\nprint(total)\n```\n{OUTPUT_MARKER}"
    return guess(task, history, rng)


def random_policy(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    pieces = [
        "```python\n",
        "print(1)",
        "\n",
        OUTPUT_MARKER,
        "<answer>",
        "7",
        "</answer>",
        "```",
        "x",
        "\\boxed{3}",
    ]
    return "".join(rng.choice(pieces) for _ in range(rng.randint(1, 6)))


STRATEGIES = {"expert": expert, "guess": guess, "buggy": buggy, "random": random_policy}

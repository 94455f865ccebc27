"""Test-only envs that break one promise each, for the one-line-error tests of issue 44 (items
10, 11). Loaded by the `steprl` commands the tests run, through ``--plugin faulty_envs`` (with
tests/ on PYTHONPATH): importing registers them, so no in-process test imports this module (a
test over "every registered env" would meet them).

* ``bad_text``: its text carries a lone surrogate (U+D800, what ``bytes.decode(errors=
  "surrogateescape")`` or a JSON ``"\\ud800"`` escape leaves): in the field `where` names,
  "system_prompt", "reset" (the first observation) or "step" (every later one; the default).
  Otherwise "ok" answers right in one turn.
* ``no_eval``: as ``bad_text`` with clean text, but its task factory's eval split is empty.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from steprl.envs.base import Env, Observation, Transition
from steprl.envs.registry import EnvSpec, register
from steprl.types import Task

LONE = "\ud800"


class BadText(Env):
    """See the module docstring."""

    def __init__(self, where: str = "step") -> None:
        self.where = where
        self.system_prompt = f"say ok {LONE}" if where == "system_prompt" else "say ok"

    def reset(self, task: Task, seed: int) -> Observation:
        return Observation(f"{task.prompt} {LONE}" if self.where == "reset" else task.prompt)

    def step(self, action: str) -> Transition:
        win = float(action.strip() == "ok")
        info = {"reward_components": {"outcome": win}, "action_kind": "answer" if win else "invalid"}
        text = f"odd {LONE} text" if self.where == "step" else "done"
        return Transition(text, win, bool(win), info=info)

    def close(self) -> None:
        pass


def _tasks(name: str, splits: tuple[str, ...]) -> Any:
    def tasks(split: str, seed: int, **_: Any) -> Iterator[Task]:
        if split not in splits:
            return  # an empty split: the generator ends at once
        for i in itertools.count():
            yield Task(id=f"{name}-{split}-{i}", prompt=f"{split} {i}", env=name, seed=seed + i, answer="ok")

    return tasks


for _name, _factory, _splits in (
    ("bad_text", BadText, ("train", "eval")),
    ("no_eval", lambda: BadText(where="none"), ("train",)),
):
    register(
        EnvSpec(
            name=_name,
            factory=_factory,
            tasks=_tasks(_name, _splits),
            strategies={"expert": lambda task, h, rng: "ok", "random": lambda task, h, rng: "x"},
            max_turns=1,
            description="test-only: an env that breaks one promise",
        ),
        replace=True,
    )

"""Test-only envs for the deadline and env-contract tests (issue 23, items 8-10).

Loaded by the `steprl` commands the tests run, through ``--plugin hang_envs`` (with this
directory on PYTHONPATH): importing registers them. In-process tests register them only while
they run (`register_all`, then removed from `ENVS`), so that no other test (e.g. "every
registered env passes check-env") meets them.

* ``hang``: the action "ok" answers right (reward 1), "x" wrong, anything else is shown an
  error. Its tool, `step`, blocks in
  `time.sleep(seconds)` on the tasks `hang_on` picks: nothing wakes it, `close()` included (a
  sync tool that hangs). `hang_on`: "none", "all", "train", "eval", "every:N" (the tasks whose
  index is a multiple of N, both splits) or "from:N" (train tasks from index N on). On the tasks
  `bad_on` picks (same forms), every reward is `reward_as`: "str" (the text of the number, as a
  careless env returns it) or "nan". `how="spin"` makes the hung step spin the CPU instead
  (`while True: pass`, never releasing its core); `close_hangs=True` makes `close()` sleep forever.
* ``hang_noeval``: as ``hang``, but its task factory never yields an eval task (a filter that
  never matches, over a slow endless source).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

from steprl.envs.base import Env, Observation, Transition
from steprl.envs.registry import EnvSpec, register
from steprl.types import Task


def _task(name: str, split: str, seed: int, i: int) -> Task:
    return Task(
        id=f"{name}-{split}-{i}",
        prompt=f"{split} {seed} {i}",
        env=name,
        seed=seed + i,
        answer="ok",
        params={"split": split, "index": i},
    )


def _tasks(split: str, seed: int, **_: Any) -> Iterator[Task]:
    for i in itertools.count():
        yield _task("hang", split, seed, i)


def _no_eval_tasks(split: str, seed: int, **_: Any) -> Iterator[Task]:
    for i in itertools.count():
        if split == "train":
            yield _task("hang_noeval", split, seed, i)
        else:
            time.sleep(0.01)  # looking for an eval task that never comes


def _picks(rule: str, task: Task) -> bool:
    split, index = task.params["split"], int(task.params["index"])
    kind, _, n = rule.partition(":")
    return (
        kind == "all"
        or kind == split
        or (kind == "every" and index % int(n) == 0)
        or (kind == "from" and split == "train" and index >= int(n))
    )


class HangEnv(Env):
    """See the module docstring."""

    system_prompt = "say ok"

    def __init__(
        self,
        hang_on: str = "none",
        seconds: float = 3600.0,
        bad_on: str = "none",
        reward_as: str = "float",
        how: str = "sleep",
        close_hangs: bool = False,
    ) -> None:
        self.hang_on, self.seconds, self.bad_on, self.reward_as = hang_on, seconds, bad_on, reward_as
        self.how, self.close_hangs = how, close_hangs
        self.task: Task | None = None

    def reset(self, task: Task, seed: int) -> Observation:
        self.task = task
        return Observation(task.prompt)

    def step(self, action: str) -> Transition:
        assert self.task is not None
        if _picks(self.hang_on, self.task):
            if self.how == "spin":
                while True:  # a busy loop: holds a core (and the GIL) until its process dies
                    pass
            time.sleep(self.seconds)
        win = float(action == "ok")
        reward: Any = win
        if _picks(self.bad_on, self.task):
            reward = {"str": str(win), "nan": float("nan")}[self.reward_as]
        if action not in ("ok", "x"):  # the strategies' actions; anything else is malformed
            info = {"reward_components": {"outcome": 0.0}, "action_kind": "invalid"}
            return Transition("<error>answer ok or x</error>", reward, False, info=info)
        info = {"reward_components": {"outcome": win}, "action_kind": "answer"}
        return Transition("done", reward, True, info=info)

    def close(self) -> None:
        if self.close_hangs:
            time.sleep(3600.0)


NAMES = ("hang", "hang_noeval")


def register_all() -> None:
    for name, tasks in zip(NAMES, (_tasks, _no_eval_tasks), strict=True):
        register(
            EnvSpec(
                name=name,
                factory=HangEnv,
                tasks=tasks,
                strategies={"expert": lambda task, h, rng: "ok", "random": lambda task, h, rng: "x"},
                max_turns=1,
                description="test-only: a tool that hangs, rewards of the wrong type",
            ),
            replace=True,
        )


register_all()  # as a --plugin; the in-process tests register and remove them around each test

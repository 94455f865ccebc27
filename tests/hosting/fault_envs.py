"""Test-only envs that misbehave on purpose, for the env-server fault tests.

Imported in the test process and, through ``--plugin fault_envs`` (with this directory on
PYTHONPATH), in the server process; importing registers them (replacing earlier
registrations, so a re-import is harmless). Every env accepts any action text.

* ``fault_count``: counts the steps it applied; ends after `episode_len` steps. The observation
  says how many were applied, which makes a double-applied step visible through the wire.
* ``fault_sleep``: sleeps `seconds` in `where` ("create", "reset", "step"), or until `close()`
  (a hung tool that close() can abort; `close_wakes=False` makes it ignore close too).
* ``fault_raise``: raises in `where` (an env bug).
* ``fault_async``: async methods; `step` awaits `asyncio.sleep(seconds)`.
* ``fault_info``: puts values JSON cannot carry into `info` (NaN, sets, bytes, enums, objects).
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import threading
from collections.abc import Iterator
from typing import Any

from steprl.envs.base import Observation, Transition
from steprl.envs.registry import EnvSpec, register
from steprl.types import Task

ANSWER = "<answer>ok</answer>"


def _tasks(name: str):
    def tasks(split: str, seed: int, **_: Any) -> Iterator[Task]:
        for i in itertools.count():
            yield Task(id=f"{name}-{split}-{seed}-{i}", prompt="go", env=name, seed=i, answer="ok")

    return tasks


def _always(text: str):
    return lambda task, history, rng: text


class CountingEnv:
    """Counts applied steps; ends (reward 1) after `episode_len` of them."""

    def __init__(self, episode_len: int = 3) -> None:
        self.episode_len = episode_len
        self.stop_strings = ("</answer>",)
        self.system_prompt = "count"
        self.applied = 0

    def reset(self, task: Task, seed: int) -> Observation:
        self.applied = 0
        return Observation(text=f"ready {task.id}", info={"seed": seed})

    def step(self, action: str) -> Transition:
        self.applied += 1
        done = self.applied >= self.episode_len
        return Transition(f"applied {self.applied}", float(done), done, info={"applied": self.applied})

    def close(self) -> None:
        pass


class SleepyEnv(CountingEnv):
    """Sleeps in `where` for `seconds`, or until close() (unless `close_wakes=False`)."""

    def __init__(
        self, where: str = "step", seconds: float = 3600.0, close_wakes: bool = True, **kw: Any
    ) -> None:
        super().__init__(**kw)
        self.where, self.seconds, self.close_wakes = where, seconds, close_wakes
        self._wake = threading.Event()
        if where == "create":
            self._wake.wait(seconds)

    def _maybe_sleep(self, here: str) -> None:
        if self.where == here:
            self._wake.wait(self.seconds)

    def reset(self, task: Task, seed: int) -> Observation:
        self._maybe_sleep("reset")
        return super().reset(task, seed)

    def step(self, action: str) -> Transition:
        self._maybe_sleep("step")
        return super().step(action)

    def close(self) -> None:
        if self.close_wakes:
            self._wake.set()


class RaisingEnv(CountingEnv):
    def __init__(self, where: str = "step", **kw: Any) -> None:
        super().__init__(**kw)
        self.where = where

    def reset(self, task: Task, seed: int) -> Observation:
        if self.where == "reset":
            raise RuntimeError("env bug in reset")
        return super().reset(task, seed)

    def step(self, action: str) -> Transition:
        if self.where == "step":
            raise RuntimeError("env bug in step")
        return super().step(action)


class AsyncEnv(CountingEnv):
    def __init__(self, seconds: float = 0.0, **kw: Any) -> None:
        super().__init__(**kw)
        self.seconds = seconds

    async def reset(self, task: Task, seed: int) -> Observation:  # type: ignore[override]
        return super().reset(task, seed)

    async def step(self, action: str) -> Transition:  # type: ignore[override]
        await asyncio.sleep(self.seconds)
        return super().step(action)

    async def close(self) -> None:  # type: ignore[override]
        pass


class Colour(enum.Enum):
    RED = "red"


class WeirdInfoEnv(CountingEnv):
    def step(self, action: str) -> Transition:
        t = super().step(action)
        info = {
            "tuple": (1, 2),
            "set": {3, 1},
            "nan": float("nan"),
            "bytes": b"\xffok",
            "enum": Colour.RED,
            "nested": {1: [object()]},
        }
        return Transition(t.observation, t.reward, t.terminated, info=info)


def _spec(name: str, factory: Any) -> EnvSpec:
    return EnvSpec(
        name=name,
        factory=factory,
        tasks=_tasks(name),
        strategies={"expert": _always(ANSWER), "random": _always("x")},
        max_turns=4,
        description=f"test-only fault env ({factory.__name__})",
    )


for _name, _factory in {
    "fault_count": CountingEnv,
    "fault_sleep": SleepyEnv,
    "fault_raise": RaisingEnv,
    "fault_async": AsyncEnv,
    "fault_info": WeirdInfoEnv,
}.items():
    register(_spec(_name, _factory), replace=True)

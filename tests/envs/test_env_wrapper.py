"""Every env wrapper forwards the members the core reads (`EnvWrapper`), from an env that has
them and from one that has none, after `reset` (when the loop reads them)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from steprl.envs.base import Env, EnvWrapper, Observation, ToolInfo, Transition, env_tools, maybe_await
from steprl.envs.deadline import DeadlineEnv
from steprl.envs.library.collapse import _TrainRewardEnv
from steprl.envs.library.latency import SlowEnv
from steprl.hosting.pool import EnvPool, _PooledEnv
from steprl.rollout.demos import _Recorder
from steprl.types import Task

TASK = Task(id="t", prompt="hi", env="test")


class _Backend:
    name = "test"

    def __init__(self, env: Env) -> None:
        self.env = env

    def make_env(self, task: Task) -> Env:
        return self.env

    def close(self) -> None:
        pass


#: How each wrapper is made around an inner env (the pool makes it in `reset`).
WRAP: dict[type[EnvWrapper], Callable[[Any], Any]] = {
    DeadlineEnv: lambda env: DeadlineEnv(env, 5.0),
    _Recorder: _Recorder,
    SlowEnv: lambda env: SlowEnv(env, median_s=0.0, sigma=0.0, max_s=0.0),
    _PooledEnv: lambda env: EnvPool(_Backend(env), 1).make_env(TASK),
    _TrainRewardEnv: _TrainRewardEnv,  # the collapse suite's calculators (issue 27)
}


class _Full(Env):
    system_prompt = "be brief"
    stop_strings = ("</a>",)
    tools = {"add": ToolInfo("add", "adds")}

    def reset(self, task: Task, seed: int) -> Observation:
        return Observation(task.prompt)

    def step(self, action: str) -> Transition:
        return Transition("", 0.0, True)

    def close(self) -> None:
        pass


class _Bare(Env):  # the protocol's defaults
    reset, step, close = _Full.reset, _Full.step, _Full.close


class _NoTools:  # not an `Env` subclass: no `tools` at all
    system_prompt, stop_strings = "", ()
    reset, step, close = _Full.reset, _Full.step, _Full.close


def _members(wrap: Callable[[Any], Any], inner: object) -> tuple[object, object, object]:
    """(system_prompt, stop_strings, tools as the core reads them) of the wrapper, after reset."""

    async def go() -> tuple[object, object, object]:
        env = wrap(inner)
        await env.reset(TASK, 0)
        try:
            return env.system_prompt, tuple(env.stop_strings), dict(env_tools(env))
        finally:
            await maybe_await(env.close())

    return asyncio.run(go())


def test_every_wrapper_in_steprl_is_covered() -> None:
    found = {c for c in EnvWrapper.__subclasses__() if c.__module__.startswith("steprl.")}
    assert found == set(WRAP), "add the new wrapper to WRAP"


@pytest.mark.parametrize("cls", list(WRAP), ids=lambda c: c.__name__)
def test_wrapper_forwards_the_members_the_core_reads(cls: type[EnvWrapper]) -> None:
    assert _members(WRAP[cls], _Full()) == ("be brief", ("</a>",), _Full.tools)
    assert _members(WRAP[cls], _Bare()) == ("", (), {})  # type: ignore[abstract]  # the defaults
    assert _members(WRAP[cls], _NoTools()) == ("", (), {})  # no `tools` at all: none

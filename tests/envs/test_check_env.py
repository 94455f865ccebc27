"""Every registered env passes `check_env`; the checker catches broken envs; the registry API."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from typing import Any

import pytest

from steprl.envs.base import Env, Observation, Transition
from steprl.envs.check import EnvCheckError, EnvCheckReport, check_env, check_spec
from steprl.envs.library.calculator import STRATEGIES, CalculatorEnv, make_tasks
from steprl.envs.registry import ENVS, EnvSpec, UnknownEnvError, get_spec, make_env, register
from steprl.envs.registry import make_tasks as registry_tasks
from steprl.types import Task


@pytest.mark.parametrize("name", sorted(ENVS))
def test_every_registered_env_passes_check_env(name: str):
    report = check_env(name, n_tasks=20, seed=0)
    assert isinstance(report, EnvCheckReport)
    assert report.expert_success_rate == 1.0
    assert report.random_success_rate < 1.0
    assert report.mean_expert_tool_calls >= 0.0
    assert set(ENVS[name].strategies) <= set(report.strategy_success)


def test_calculator_report():
    report = check_env("calculator", n_tasks=30, seed=1)
    assert report.n_tasks == 30
    assert report.mean_expert_tool_calls >= 1.5
    assert report.mean_expert_turns == pytest.approx(report.mean_expert_tool_calls + 1)


def test_env_params_reach_the_factory():
    report = check_env("calculator", n_tasks=5, env_params={"max_ops_per_call": 3, "max_invalid_actions": 0})
    assert report.expert_success_rate == 1.0


# --- registry ---------------------------------------------------------------------------------------


def test_registry_lookup():
    assert isinstance(make_env("calculator", max_invalid_actions=1), CalculatorEnv)
    assert [t.id for t in registry_tasks("calculator", "eval", 0, 3)] == [
        t.id for t in make_tasks("eval", 0, 3)
    ]
    with pytest.raises(UnknownEnvError, match="known envs: .*calculator") as info:
        get_spec("calculater")
    assert isinstance(info.value, KeyError)


def test_specs_need_expert_and_random():
    with pytest.raises(ValueError, match="lacks strategies"):
        EnvSpec("x", CalculatorEnv, make_tasks, {"expert": STRATEGIES["expert"]})


def test_register_refuses_to_shadow(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr("steprl.envs.registry.ENVS", dict(ENVS))
    with pytest.raises(ValueError, match="already registered"):
        register(ENVS["calculator"])
    register(dataclasses.replace(ENVS["calculator"], name="calc2"))


# --- the checker catches broken envs -----------------------------------------------------------------

CALC = ENVS["calculator"]


def _calc_tasks(split: str, seed: int, **params: Any) -> Iterator[Task]:
    return make_tasks(split, seed, min_calls=1, max_calls=1, **params)


def _spec(**changes: Any) -> EnvSpec:
    return dataclasses.replace(CALC, **{"tasks": _calc_tasks, **changes})


class AsyncCalculator(Env):
    """The calculator behind async methods: the checker must await them (and the Env defaults
    stand in for system_prompt)."""

    def __init__(self, **params: Any) -> None:
        self.inner = CalculatorEnv(**params)
        self.stop_strings = self.inner.stop_strings

    async def reset(self, task: Task, seed: int) -> Observation:
        return self.inner.reset(task, seed)

    async def step(self, action: str) -> Transition:
        return self.inner.step(action)

    async def close(self) -> None:
        self.inner.close()


def test_async_envs_pass():
    assert check_spec(_spec(factory=AsyncCalculator), n_tasks=5).expert_success_rate == 1.0


class Wrapped(CalculatorEnv):
    """A calculator whose `step` result is passed through `mangle` (to break one rule at a time)."""

    def mangle(self, t: Transition) -> Transition:
        return t

    def step(self, action: str) -> Transition:
        return self.mangle(super().step(action))


class BadSum(Wrapped):
    def mangle(self, t: Transition) -> Transition:
        return dataclasses.replace(t, reward=t.reward + 0.5)


class NaNReward(Wrapped):
    def mangle(self, t: Transition) -> Transition:
        return dataclasses.replace(t, reward=float("nan"))


class Noisy(CalculatorEnv):
    def reset(self, task: Task, seed: int) -> Observation:
        super().reset(task, seed)
        return Observation(f"{task.prompt} (noise {random.random()})")


class RaisesOnGarbage(Wrapped):
    def step(self, action: str) -> Transition:
        if "<" not in action:
            raise ValueError("cannot parse")
        return super().step(action)


class NoStops(CalculatorEnv):
    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.stop_strings = "</calc>"  # a bare string, not a list


class PromptNotStr(CalculatorEnv):
    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.system_prompt = None  # type: ignore[assignment]


class NoSystemPrompt:
    """Duck-typed env (does not subclass Env) that forgot system_prompt."""

    stop_strings = ("</calc>",)

    def __init__(self, **params: Any) -> None:
        self.inner = CalculatorEnv(**params)

    def reset(self, task: Task, seed: int) -> Any:
        return self.inner.reset(task, seed)

    def step(self, action: str) -> Any:
        return self.inner.step(action)

    def close(self) -> None:
        self.inner.close()


class CloseOnce(CalculatorEnv):
    closed = False

    def close(self) -> None:
        if self.closed:
            raise RuntimeError("already closed")
        self.closed = True


def _wrong_expert(task: Task, history: Any, rng: random.Random) -> str:
    return "<answer>0</answer>"


def _leaky_tasks(split: str, seed: int, **params: Any) -> Iterator[Task]:
    return make_tasks("train", seed, min_calls=1, max_calls=1)  # ignores the split


def _global_rng_tasks(split: str, seed: int, **params: Any) -> Iterator[Task]:
    return make_tasks(split, random.randrange(10**9), min_calls=1, max_calls=1)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"factory": BadSum}, "sum of reward_components"),
        ({"factory": NaNReward}, "finite float"),
        ({"factory": Noisy}, "replaying task"),
        ({"factory": RaisesOnGarbage}, "must become error observations"),
        ({"factory": NoStops}, "stop_strings"),
        ({"factory": PromptNotStr}, "system_prompt=None"),
        ({"factory": NoSystemPrompt}, "lacks system_prompt; subclass steprl.envs.base.Env"),
        ({"factory": CloseOnce}, "idempotent"),
        ({"strategies": {**STRATEGIES, "expert": _wrong_expert}}, "expert did not solve"),
        ({"tasks": _leaky_tasks}, "train and eval share prompts"),
        ({"tasks": _global_rng_tasks}, "differ between two calls"),
        ({"max_turns": 1}, "raise EnvSpec.max_turns"),
    ],
)
def test_checker_catches(changes: dict[str, Any], message: str):
    spec = _spec(**changes)
    if "max_turns" in changes:  # two-call tasks cannot be solved in one turn
        spec = dataclasses.replace(spec, tasks=CALC.tasks)
    with pytest.raises(EnvCheckError, match=message):
        check_spec(spec, n_tasks=5)


def test_env_subclass_inherits_the_defaults_the_core_reads():
    from steprl.envs.base import Env, Observation, Transition

    class Minimal(Env):
        def reset(self, task: Task, seed: int) -> Observation:
            return Observation("hi")

        def step(self, action: str) -> Transition:
            return Transition("", 1.0, True)

        def close(self) -> None:
            pass

    env = Minimal()
    assert isinstance(env, Env) and env.system_prompt == "" and tuple(env.stop_strings) == ()

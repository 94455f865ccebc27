"""Every registered env passes `check_env`; the checker catches broken envs; the registry API."""

from __future__ import annotations

import dataclasses
import functools
import random
import time
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


# --- declared rules: stochastic, not replayable, split by seed ----------------------------------------


class Coin(Env):
    """Answer and a coin (seeded by reset's seed) decides: the expert wins with probability `p`."""

    def __init__(self, p: float = 0.7, **params: Any) -> None:
        self.p = p

    def reset(self, task: Task, seed: int) -> Observation:
        self.rng = random.Random(seed)
        return Observation(task.prompt)

    def step(self, action: str) -> Transition:
        if "<answer>" not in action:
            return Transition(
                "<error>no answer</error>",
                -0.1,
                False,
                info={"reward_components": {"outcome": 0.0, "format": -0.1}, "action_kind": "invalid"},
            )
        win = float(self.rng.random() < self.p)
        return Transition(
            "", win, True, info={"reward_components": {"outcome": win}, "action_kind": "answer"}
        )

    def close(self) -> None:
        pass


class ClockCoin(Coin):
    """A coin that shows the wall clock: not replayable."""

    def reset(self, task: Task, seed: int) -> Observation:
        super().reset(task, seed)
        return Observation(f"{task.prompt} at {time.perf_counter_ns()} ns")


def _coin_tasks(split: str, seed: int, **params: Any) -> Iterator[Task]:
    rng = random.Random(f"{split}-{seed}")
    for i in range(10**6):
        yield Task(id=f"coin-{split}-{i}", prompt=f"flip coin {rng.randrange(10**9)}", env="coin", seed=i)


def _fixed_start_tasks(split: str, seed: int, overlap: bool = False, **params: Any) -> Iterator[Task]:
    base = 0 if split == "train" or overlap else 10**6  # disjoint seed ranges, unless told otherwise
    for i in range(10**6):
        yield Task(id=f"coin-{split}-{i}", prompt="flip the coin", env="coin", seed=base + seed * 1000 + i)


def _answer(task: Task, history: Any, rng: random.Random) -> str:
    return "<answer>heads</answer>"


def _junk(task: Task, history: Any, rng: random.Random) -> str:
    return rng.choice(["", "<answer>tails</answer>", "flip"])


def _coin(**changes: Any) -> EnvSpec:
    fields: dict[str, Any] = {
        "name": "coin",
        "factory": Coin,
        "tasks": _coin_tasks,
        "strategies": {"expert": _answer, "random": _junk},
        "max_turns": 2,
        **changes,
    }
    return EnvSpec(**fields)


def test_default_rules_ran_as_specified_and_summary():
    report = check_env("calculator", n_tasks=5)
    assert report.ran == (
        "api",
        "tasks",
        "split",
        "replay",
        "robustness",
        "solvability",
        "strategies",
        "close",
    )
    assert dict(report.relaxed) == {}
    text = report.summary()
    print(text)
    assert "ran: api, tasks, split, replay" in text and "relaxed" not in text
    assert "expert 1.00" in text and "random " in text


def test_stochastic_expert_measured_over_seeds():
    report = check_spec(_coin(stochastic=True, min_expert_success=0.5, expert_seeds=10), n_tasks=10)
    assert report.expert_episodes == 100 and 0.5 <= report.expert_success_rate < 1.0
    assert "solvability" not in report.ran
    why = report.relaxed["solvability"]
    assert why.startswith("expert success 0.") and why.endswith(">= 0.50 over 10 tasks x 10 seeds")
    assert f"relaxed solvability: {why}" in report.summary()


def test_stochastic_expert_below_the_minimum_fails():
    with pytest.raises(EnvCheckError, match=r"below min_expert_success=0\.95 .*lower min_expert_success"):
        check_spec(_coin(stochastic=True, min_expert_success=0.95, expert_seeds=10), n_tasks=10)


def test_a_losing_expert_fails_the_default_rule():
    with pytest.raises(EnvCheckError, match="expert did not solve"):
        check_spec(_coin(), n_tasks=10)


def test_min_below_one_alone_relaxes_solvability():
    report = check_spec(_coin(factory=functools.partial(Coin, p=1.0), min_expert_success=0.9), n_tasks=4)
    assert report.expert_episodes == 4 and report.relaxed["solvability"].startswith("expert success 1.00")


def test_not_replayable_relaxes_replay_with_the_reason():
    spec = _coin(factory=functools.partial(ClockCoin, p=1.0))
    with pytest.raises(EnvCheckError, match="replaying task .*EnvSpec.replayable=False"):
        check_spec(spec, n_tasks=5)
    spec = dataclasses.replace(spec, replayable=False, not_replayable_because="reads the wall clock")
    report = check_spec(spec, n_tasks=5)
    assert report.relaxed == {"replay": "not replayable: reads the wall clock"}
    assert (
        "replay" not in report.ran
        and "relaxed replay: not replayable: reads the wall clock" in report.summary()
    )


def test_noisy_calculator_passes_when_declared_not_replayable():
    spec = _spec(factory=Noisy, replayable=False, not_replayable_because="prints random noise")
    assert check_spec(spec, n_tasks=5).relaxed["replay"] == "not replayable: prints random noise"


def test_split_by_seed():
    fixed = _coin(factory=functools.partial(Coin, p=1.0), tasks=_fixed_start_tasks)
    with pytest.raises(EnvCheckError, match="share prompts .*split_by='seed'"):
        check_spec(fixed, n_tasks=5)
    report = check_spec(dataclasses.replace(fixed, split_by="seed"), n_tasks=5)
    assert report.relaxed["split"].startswith("by task seed, not prompt (1 distinct prompt(s)")
    with pytest.raises(EnvCheckError, match="share task seeds"):
        check_spec(dataclasses.replace(fixed, split_by="seed"), n_tasks=5, task_params={"overlap": True})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"replayable": False}, "needs not_replayable_because"),
        ({"replayable": False, "not_replayable_because": "  "}, "needs not_replayable_because"),
        ({"min_expert_success": 0.0}, r"min_expert_success must be in \(0, 1\]"),
        ({"min_expert_success": 1.5}, r"min_expert_success must be in \(0, 1\]"),
        ({"expert_seeds": 0}, "expert_seeds must be >= 1"),
        ({"split_by": "hash"}, "split_by must be 'prompt' or 'seed'"),
    ],
)
def test_spec_rules_are_validated(changes: dict[str, Any], message: str):
    with pytest.raises(ValueError, match=message):
        _coin(**changes)


def test_episode_seeds_are_derived_from_the_task_seed():
    from steprl.envs.check import episode_seeds

    seeds = episode_seeds(7, 5)
    assert seeds[0] == 7 and len(set(seeds)) == 5 and seeds == episode_seeds(7, 5)
    assert episode_seeds(7, 1) == [7]

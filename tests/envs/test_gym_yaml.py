"""Gymnasium from YAML alone (`gym_spec`): conformance under the declared rules, renderers, bad inputs."""

from __future__ import annotations

import random
from itertools import islice
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

from steprl.envs.adapters.gym_actions import action_codec
from steprl.envs.adapters.gym_render import blackjack_obs, render_blackjack, render_repr, strip_ansi
from steprl.envs.adapters.gym_yaml import ALLOWED, KNOWN, GymParamsError, gym_spec
from steprl.envs.adapters.gymnasium_env import GymnasiumEnv
from steprl.envs.check import check_spec
from steprl.envs.registry import get_spec
from steprl.errors import UserError

# Every toy-text env of the installed Gymnasium (1.4: Taxi is Taxi-v4, CliffWalking is CliffWalking-v1),
# with the checks the declared rules relax.
CASES: dict[str, tuple[dict[str, Any], set[str]]] = {
    "frozenlake": ({"id": "FrozenLake-v1", "kwargs": {"is_slippery": False}}, {"split"}),
    "frozenlake-slippery": (
        {"id": "FrozenLake-v1", "kwargs": {"is_slippery": True}},
        {"split", "solvability"},
    ),
    "frozenlake-slippery-long": (
        {"id": "FrozenLake-v1", "kwargs": {"map_name": "4x4"}, "max_turns": 100},
        {"split", "solvability"},
    ),
    "taxi": ({"id": "Taxi-v4"}, set()),
    "blackjack": ({"id": "Blackjack-v1"}, {"solvability"}),
    "cliffwalking": ({"id": "CliffWalking-v1"}, {"split"}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_toy_text_envs_pass_check_spec_with_their_declared_rules(case: str):
    params, relaxed = CASES[case]
    spec = gym_spec(params)
    assert spec.name == f"gym:{params['id']}"
    report = check_spec(spec, n_tasks=20, seed=0)
    print(report.summary())
    assert set(report.relaxed) == relaxed
    assert set(report.ran) | relaxed == {
        "api",
        "tasks",
        "split",
        "replay",
        "robustness",
        "solvability",
        "strategies",
        "close",
    }
    assert report.expert_success_rate >= spec.min_expert_success
    assert {"expert", "guess", "random"} <= set(report.strategy_success)
    text = report.summary()
    assert f"check_env {spec.name!r}: passed on 20 tasks" in text
    for check, why in report.relaxed.items():
        assert f"relaxed {check}: {why}" in text


def test_summaries_say_what_was_relaxed_and_why():
    slippery = check_spec(gym_spec(CASES["frozenlake-slippery-long"][0]))
    assert slippery.relaxed["split"].startswith("by task seed, not prompt (1 distinct prompt(s) in 100")
    # the best policy reaches the goal of the slippery 4x4 map in 74% of episodes within 100 steps
    assert slippery.relaxed["solvability"] == "expert success 0.74 >= 0.59 over 20 tasks x 5 seeds"
    taxi = check_spec(gym_spec({"id": "Taxi-v4"}))
    assert "relaxed" not in taxi.summary() and "ran: api, tasks, split, replay" in taxi.summary()
    deterministic = gym_spec({"id": "FrozenLake-v1", "kwargs": {"is_slippery": False}})
    assert not deterministic.stochastic and deterministic.min_expert_success == 1.0
    assert deterministic.split_by == "seed" and gym_spec({"id": "Taxi-v4"}).split_by == "prompt"


def test_tasks_come_from_disjoint_seed_ranges_when_the_start_is_fixed():
    spec = gym_spec({"id": "CliffWalking-v1"})
    train = list(islice(spec.tasks("train", 0), 50))
    evals = list(islice(spec.tasks("eval", 0), 50))
    assert {t.prompt for t in train} == {t.prompt for t in evals}  # one start state...
    assert max(t.seed for t in train) < min(t.seed for t in evals)  # ...told apart by seed
    assert all(t.env == spec.name for t in train + evals)


def test_the_family_resolves_through_the_registry():
    params = {"id": "FrozenLake-v1", "kwargs": {"is_slippery": False}}
    spec = get_spec("gym", params)
    assert spec.name == "gym:FrozenLake-v1" and get_spec("gym", dict(params)) is spec
    env = spec.factory(**params)
    assert isinstance(env, GymnasiumEnv) and "left, down, right, up" in env.system_prompt
    assert "frozen lake" in env.system_prompt
    other = spec.factory(**{**params, "max_invalid_actions": 0})
    assert isinstance(other, GymnasiumEnv) and other.max_invalid_actions == 0
    with pytest.raises(GymParamsError, match="env.params.colour: unknown key"):
        spec.factory(**params, colour="red")


def test_the_slippery_expert_follows_the_real_episode_under_another_seed():
    params = {"id": "FrozenLake-v1", "kwargs": {"is_slippery": True}, "max_turns": 100}
    spec = gym_spec(params)
    task = next(spec.tasks("train", 0))
    expert = spec.strategies["expert"]
    wins = 0
    for seed in range(20):  # never the task's seed: the replay's own slips differ from the episode's
        env = spec.factory()
        assert isinstance(env, GymnasiumEnv)
        env.reset(task, 10_000 + seed)
        history: list[tuple[str, str]] = []
        for _ in range(spec.max_turns):
            action = expert(task, history, random.Random(0))
            shadow = expert.shadow  # type: ignore[attr-defined]
            assert shadow.raw_obs == env.raw_obs  # the expert acts on the real state
            t = env.step(action)
            history.append((action, t.observation))
            if t.terminated or t.truncated:
                break
        wins += t.info["reward_components"]["outcome"] == 1.0
    assert wins >= 8  # 74% expected


def test_guess_mixes_the_expert_with_legal_moves():
    spec = gym_spec({"id": "Taxi-v4"})
    task = next(spec.tasks("train", 0))
    moves = {spec.strategies["guess"](task, [], random.Random(i)) for i in range(40)}
    assert len(moves) > 1 and all(m.startswith("<answer>") for m in moves)


# --- renderers --------------------------------------------------------------------------------------


def test_strip_ansi_keeps_highlights_as_brackets():
    assert strip_ansi("\x1b[41mS\x1b[0mFFF\nFHFH") == "[S]FFF\nFHFH"
    assert strip_ansi("|\x1b[35mY\x1b[0m| \x1b[43m \x1b[0m|\x1b[34;1mB\x1b[0m") == "|Y| [ ]|B"
    assert strip_ansi("plain\x1b[2K text") == "plain text"


def test_ansi_render_has_no_escape_codes():
    spec = gym_spec({"id": "FrozenLake-v1", "kwargs": {"is_slippery": False}, "render": "ansi"})
    task = next(spec.tasks("train", 0))
    env = spec.factory()
    assert isinstance(env, GymnasiumEnv)
    first = env.reset(task, task.seed).text
    assert first == task.prompt == "[S]FFF\nFHFH\nFFFH\nHFFG"
    after = env.step("<answer>down</answer>").observation
    assert after == "  (Down)\nSFFF\n[F]HFH\nFFFH\nHFFG" and "\x1b" not in after
    taxi = gym_spec({"id": "Taxi-v4", "render": "ansi"})
    assert all("\x1b" not in t.prompt and "[" in t.prompt for t in islice(taxi.tasks("train", 0), 5))


def test_builtin_renderers_and_render_options():
    lake = next(gym_spec({"id": "FrozenLake-v1"}).tasks("train", 0)).prompt
    assert lake == "AFFF\nFHFH\nFFFH\nHFFG"
    cliff = next(gym_spec({"id": "CliffWalking-v1"}).tasks("train", 0)).prompt
    assert cliff.splitlines()[-1] == "xCCCCCCCCCCT"
    taxi = next(gym_spec({"id": "Taxi-v4"}).tasks("train", 0)).prompt
    assert taxi.startswith("taxi at row ") and "destination" in taxi
    assert render_blackjack(None, (15, 1, 1)) == "your sum 15, usable ace; dealer shows A"
    assert blackjack_obs("your sum 15, usable ace; dealer shows A") == (15, 1, 1)
    assert blackjack_obs("(12, 10, 0)") == (12, 10, 0)
    assert render_repr(None, np.array([1, 2])) == "[1, 2]"
    repr_lake = gym_spec({"id": "FrozenLake-v1", "kwargs": {"is_slippery": False}, "render": "repr"})
    assert next(repr_lake.tasks("train", 0)).prompt == "0"
    custom = gym_spec({"id": "FrozenLake-v1", "render": "tests.envs.test_gym_yaml:render_cell"})
    assert next(custom.tasks("train", 0)).prompt == "cell 0 of 16"


def render_cell(env: Any, obs: Any) -> str:
    """A user renderer, loaded by import path: it gets the env as well as the observation."""
    return f"cell {int(obs)} of {env.unwrapped.observation_space.n}"


def test_gymnasium_env_takes_render_or_render_obs_not_both():
    env = GymnasiumEnv("FrozenLake-v1", render=render_cell)
    task = next(gym_spec({"id": "FrozenLake-v1"}).tasks("train", 0))
    assert env.reset(task, task.seed).text == "cell 0 of 16"
    assert GymnasiumEnv("FrozenLake-v1", render_obs=str).reset(task, task.seed).text == "0"
    with pytest.raises(ValueError, match="not both"):
        GymnasiumEnv("FrozenLake-v1", render=render_cell, render_obs=str)


# --- actions and episode ends -----------------------------------------------------------------------


def test_multidiscrete_actions_parse():
    parse, fmt, describe = action_codec(spaces.MultiDiscrete([3, 4]), None, None, None)
    for text in ("1 2", "1,2", " [1, 2] ", "1 ,  2"):
        assert parse(text).tolist() == [1, 2]
    assert fmt(np.array([2, 3])) == "2 3" and "2 integers" in describe
    for bad in ("1", "1 2 3", "3 0", "a b", "-1 0"):
        with pytest.raises(ValueError):
            parse(bad)


class Pair(gym.Env[int, Any]):
    """Two dials; the episode ends when both are right (1, 2)."""

    observation_space = spaces.Discrete(1)
    action_space = spaces.MultiDiscrete([3, 4])

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[int, dict]:
        super().reset(seed=seed)
        return 0, {}

    def step(self, action: Any) -> tuple[int, float, bool, bool, dict]:
        won = list(action) == [1, 2]
        return 0, float(won), won, False, {}


def test_multidiscrete_env_steps():
    env = GymnasiumEnv(lambda: Pair(), render_obs=str)
    task = next(gym_spec({"id": "FrozenLake-v1"}).tasks("train", 0))
    env.reset(task, task.seed)
    assert env.step("<answer>9 9</answer>").info["action_kind"] == "invalid"
    t = env.step("<answer>1,2</answer>")
    assert t.terminated and t.reward == 1.0 and t.info["env_action"] == [1, 2]


def test_truncation_stays_truncated():
    params = {"id": "FrozenLake-v1", "kwargs": {"is_slippery": False, "max_episode_steps": 3}}
    spec = gym_spec(params)
    env = spec.factory(**params)
    task = next(spec.tasks("train", 0))
    env.reset(task, task.seed)
    steps = [env.step("<answer>up</answer>") for _ in range(3)]  # against the top wall
    assert [(s.truncated, s.terminated) for s in steps] == [(False, False), (False, False), (True, False)]


# --- bad inputs: one line each, as user errors ----------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (
            {"id": "FrozenLake-v0"},
            r"env.params.id='FrozenLake-v0': Environment version v0 for `FrozenLake` "
            r"is deprecated. Please use `FrozenLake-v1` instead.",
        ),
        ({"id": "NoSuchEnv-v3"}, r"env.params.id='NoSuchEnv-v3': Environment `NoSuchEnv` doesn't exist"),
        ({"id": "MountainCarContinuous-v0"}, r"env.params.action_parser: .* Box action space"),
        (
            {"id": "FrozenLake-v1", "colour": "red"},
            r"env.params.colour: unknown key; allowed keys: id, kwargs",
        ),
        ({}, r"env.params.id: required"),
        ({"id": "FrozenLake-v1", "kwargs": {"bogus": 1}}, r"env.params.kwargs: .*bogus"),
        ({"id": "FrozenLake-v1", "max_turns": "many"}, r"env.params.max_turns: expected int"),
        ({"id": "FrozenLake-v1", "outcome": "score"}, r"env.params.outcome: 'score' is not one of"),
        ({"id": "FrozenLake-v1", "render": "pretty"}, r"env.params.render: 'pretty' is not auto"),
        ({"id": "Blackjack-v1", "render": "ansi"}, r"env.params.render: Blackjack-v1 has no ansi"),
        (
            {"id": "FrozenLake-v1", "expert": "nowhere.module:fn"},
            r"env.params.expert 'nowhere.module:fn': importing 'nowhere.module' failed: ModuleNotFoundError",
        ),
        ({"id": "FrozenLake-v1", "min_expert_success": 2.0}, r"env.params: .*min_expert_success"),
        ({"id": "Acrobot-v1"}, r"env.params.expert: there is no built-in expert for Acrobot-v1"),
    ],
)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Gymnasium warns before it raises
def test_bad_params_are_user_errors_naming_the_key(params: dict[str, Any], message: str):
    with pytest.raises(GymParamsError, match=message) as info:
        gym_spec(params)
    assert isinstance(info.value, UserError) and "\n" not in str(info.value)


def test_known_defaults_are_one_visible_dict():
    assert set(KNOWN) == {"FrozenLake", "Taxi", "CliffWalking", "Blackjack"}
    assert KNOWN["Taxi"]["outcome"] == "terminated" and KNOWN["Blackjack"]["outcome"] == "win"
    assert "id" in ALLOWED and "kwargs" in ALLOWED
    # params override the defaults
    spec = gym_spec({"id": "FrozenLake-v1", "kwargs": {"is_slippery": False}, "max_turns": 9})
    assert spec.max_turns == 9

"""gridwalk (issue 28): the optimality labels on a hand-checked grid, the strategies' labels, the
budget, and deterministic disjoint splits. `check_env` runs on it with every registered env."""

from __future__ import annotations

import json
import math
import random
from itertools import islice
from typing import Any

import pytest

from steprl.envs.base import Transition
from steprl.envs.library.gridwalk import SPEC, Grid, GridWalkEnv, make_epsilon, make_tasks, shortest_path
from steprl.envs.policy import Policy
from steprl.envs.registry import get_spec
from steprl.types import Task


def _task(**params: Any) -> Task:
    """A 3x3 grid whose centre is a wall, from the bottom-right corner to the top-left one:

    G . .      from 22 both U (to 12) and L (to 21) are 3 moves from the goal; from 21, U
    . # .      bumps into the wall and only L shortens the walk; D and R bump into the border
    . . S
    """
    base = {"size": 3, "walls": ((1, 1),), "start": (2, 2), "goal": (0, 0), "distance": 4, "budget": 6}
    return Task(id="hand", prompt="3x3 walls 11\n22 00", env="gridwalk", seed=0, params={**base, **params})


def _labels(t: Transition) -> tuple[list[str], bool, int]:
    return t.info["optimal_actions"], t.info["step_optimal"], t.info["distance"]


def _play(task: Task, policy: Policy, seed: int) -> list[Transition]:
    env, rng, history, out = GridWalkEnv(), random.Random(seed), [], []
    env.reset(task, task.seed)
    while not out or not (out[-1].terminated or out[-1].truncated):
        action = policy(task, history, rng)
        out.append(env.step(action))
        history.append((action, out[-1].observation))
    return out


def _solved(transitions: list[Transition]) -> bool:
    return math.isclose(sum(t.info["reward_components"]["outcome"] for t in transitions), 1.0)


def test_the_labels_of_a_hand_checked_grid():
    grid = Grid(3, frozenset({(1, 1)}), (0, 0))
    assert grid.optimal_moves((2, 2)) == ("L", "U")  # two optimal moves
    assert grid.optimal_moves((2, 1)) == ("L",)  # U is the wall
    assert grid.optimal_moves((0, 0)) == ()
    assert shortest_path(grid, (2, 2)) == "LLUU"

    env = GridWalkEnv()
    first = env.reset(_task(), 0)
    assert first.text == "3x3 walls 11\n22 00" and first.info["anchor"] == "22 00"
    bump = env.step("<answer>D</answer>")  # the border: a valid move, a wasted step
    assert _labels(bump) == (["L", "U"], False, 4)
    assert bump.info["action_kind"] == "tool_call" and bump.info["moved"] is False
    assert bump.observation == "\n22 00\n"
    assert _labels(env.step("<answer>left</answer>")) == (["L", "U"], True, 3)
    wall = env.step("<answer>U</answer>")
    assert _labels(wall) == (["L"], False, 3) and wall.info["anchor"] == "21 00"
    malformed = env.step("hello")
    assert _labels(malformed) == (["L"], False, 3) and malformed.info["action_kind"] == "invalid"
    assert malformed.observation.startswith("\n<error>")
    assert _labels(env.step("<answer>L</answer>")) == (["L"], True, 2)
    last = env.step("<answer>U</answer>")  # the sixth action: the budget (4 + 2) is spent
    assert _labels(last) == (["U"], True, 1)
    assert last.truncated and not last.terminated and last.info["reward_components"]["outcome"] == 0.0


def test_the_expert_takes_only_optimal_steps_and_solves_every_task():
    tasks = [*islice(make_tasks("train", 0), 30), *islice(make_tasks("eval", 1, walls=3, max_distance=6), 30)]
    for i, task in enumerate([_task(), *tasks]):
        transitions = _play(task, SPEC.strategies["expert"], seed=i)
        assert all(t.info["step_optimal"] for t in transitions), task.prompt
        assert len(transitions) == task.params["distance"] and _solved(transitions)
        assert transitions[-1].terminated and transitions[-1].info["distance"] == 0


def test_epsilon_mixes_both_labels_and_succeeds_exactly_when_the_waste_fits_the_slack():
    """A bump or a malformed action wastes one step, a move away two (there and back)."""
    outcomes, labels = [], []
    for i, task in enumerate(islice(make_tasks("train", 0), 60)):
        transitions = _play(task, SPEC.strategies["epsilon"], seed=i)
        waste = sum(0 if t.info["step_optimal"] else 2 if t.info.get("moved") else 1 for t in transitions)
        assert _solved(transitions) == (waste <= 2)
        outcomes.append(_solved(transitions))
        labels += [t.info["step_optimal"] for t in transitions]
    assert 0.3 < sum(outcomes) / len(outcomes) < 0.95 and 0.1 < labels.count(False) / len(labels) < 0.5
    always_wrong = _play(_task(), make_epsilon(1.0), seed=0)
    assert not any(t.info["step_optimal"] for t in always_wrong) and not _solved(always_wrong)


def test_random_moves_are_labelled_too():
    transitions = [t for i in range(20) for t in _play(_task(), SPEC.strategies["random"], seed=i)]
    invalid = [t for t in transitions if t.info["action_kind"] == "invalid"]
    assert invalid and not any(t.info["step_optimal"] for t in invalid)
    assert all(t.info["optimal_actions"] for t in transitions)


def test_splits_are_deterministic_and_disjoint():
    assert get_spec("gridwalk") is SPEC
    for params in ({}, {"walls": 3}, {"size": 5, "slack": 0}):
        train = list(islice(make_tasks("train", 0, **params), 300))
        assert train == list(islice(make_tasks("train", 0, **params), 300))
        evals = {t.prompt for t in islice(make_tasks("eval", 0, **params), 100)}
        assert evals and not evals & {t.prompt for t in train}
        assert all(t.params["budget"] == t.params["distance"] + params.get("slack", 2) for t in train)
    assert all(t.params["distance"] >= 2 for t in train)
    assert list(islice(make_tasks("train", 1), 5)) != list(islice(make_tasks("train", 0), 5))


def test_a_task_that_went_through_json_plays_the_same():
    task = next(make_tasks("train", 0, walls=2))
    params = json.loads(json.dumps(dict(task.params)))  # pairs come back as lists
    again = Task(task.id, task.prompt, task.env, task.seed, task.answer, params)
    first, second = _play(task, SPEC.strategies["expert"], 3), _play(again, SPEC.strategies["expert"], 3)
    assert [(t.observation, t.reward, dict(t.info)) for t in first] == [
        (t.observation, t.reward, dict(t.info)) for t in second
    ]


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"size": 11}, "size must be in"),
        ({"walls": 15}, "walls must be in"),
        ({"slack": -1}, "give a value >= 0"),
        ({"min_distance": 3, "max_distance": 2}, "min_distance <= max_distance"),
    ],
)
def test_bad_task_params_say_what_to_give(params: dict[str, Any], match: str):
    with pytest.raises(ValueError, match=match):
        make_tasks("train", 0, **params)

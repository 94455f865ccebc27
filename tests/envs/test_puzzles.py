"""The RAGEN puzzles (FrozenLake, Sokoban, bandit): conformance, solvability, determinism, fuzzing."""

from __future__ import annotations

import functools
import math
import random
import string
import time
from collections.abc import Mapping, Sequence
from itertools import islice
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from steprl.config import load_config
from steprl.envs.base import Transition
from steprl.envs.check import check_spec
from steprl.envs.library.puzzles import SPECS, BanditEnv, FrozenLakeEnv, Lake, PuzzleEnv, SokobanEnv
from steprl.envs.library.puzzles.bandit import RewardMode
from steprl.envs.library.puzzles.common import parse_direction, split_of
from steprl.envs.library.puzzles.frozenlake import shortest_path
from steprl.envs.library.puzzles.sokoban import parse_level, solve
from steprl.envs.registry import EnvSpec
from steprl.rollout.chat import PlainFormat
from steprl.types import Task

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PRINTABLE = set(string.printable) - set("\x0b\x0c\r")
NAMES = sorted(SPECS)


def make(spec: EnvSpec, **params: Any) -> PuzzleEnv:
    env = spec.factory(**params)
    assert isinstance(env, PuzzleEnv)  # sync envs: reset/step return values, not awaitables
    return env


def play(
    spec: EnvSpec,
    task: Task,
    strategy: str,
    *,
    seed: int = 0,
    max_turns: int | None = None,
    env: PuzzleEnv | None = None,
) -> tuple[str, list[str], list[Transition]]:
    """One episode of a scripted strategy: (first observation, actions, transitions)."""
    env = env if env is not None else make(spec)
    first = env.reset(task, task.seed).text
    rng = random.Random(seed)
    history: list[tuple[str, str]] = []
    actions: list[str] = []
    transitions: list[Transition] = []
    for _ in range(max_turns or spec.max_turns):
        action = spec.strategies[strategy](task, history, rng)
        t = env.step(action)
        actions.append(action)
        transitions.append(t)
        history.append((action, t.observation))
        if t.terminated or t.truncated:
            break
    return first, actions, transitions


def outcome(transitions: Sequence[Transition]) -> float:
    return sum(t.info["reward_components"]["outcome"] for t in transitions)


def success_rate(spec: EnvSpec, strategy: str, n: int, *, task_params: Mapping[str, Any] = {}, **kw) -> float:
    tasks = islice(spec.tasks("eval", 0, **task_params), n)
    wins = [math.isclose(outcome(play(spec, t, strategy, seed=i, **kw)[2]), 1.0) for i, t in enumerate(tasks)]
    return sum(wins) / n


def assert_well_formed(t: Transition) -> None:
    components = t.info["reward_components"]
    assert set(components) == {"outcome", "format", "cost"}
    assert math.isclose(sum(components.values()), t.reward, abs_tol=1e-12)
    assert set(t.observation) <= PRINTABLE
    assert set(t.info["anchor"]) <= PRINTABLE
    assert t.info["action_kind"] in ("tool_call", "invalid")
    if t.info["action_kind"] == "invalid":
        assert components["format"] == pytest.approx(-0.1) and components["outcome"] == 0.0
        assert t.info["error"] and t.info["tool_call_valid"] is None
        assert t.terminated or t.truncated or t.observation.startswith("\n<error>")
    else:
        assert t.info["tool_call_valid"] is True and t.info["error"] is None


# --- conformance and success rates ------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_check_spec_passes(name: str):
    report = check_spec(SPECS[name], n_tasks=50, seed=0)
    assert report.expert_success_rate == 1.0
    assert set(SPECS[name].strategies) == set(report.strategy_success)


@pytest.mark.parametrize(("name", "random_max"), [("frozenlake", 0.2), ("sokoban", 0.1), ("bandit", 0.6)])
def test_expert_solves_everything_random_rarely(name: str, random_max: float):
    spec = SPECS[name]
    assert success_rate(spec, "expert", 50) == 1.0
    assert success_rate(spec, "random", 100) <= random_max  # bandit: 2 arms, so chance is 1/2


@pytest.mark.parametrize(
    ("name", "imperfect"), [("frozenlake", "greedy"), ("sokoban", "noisy"), ("bandit", "guess")]
)
def test_imperfect_strategy_is_in_between(name: str, imperfect: str):
    rate = success_rate(SPECS[name], imperfect, 100)
    assert 0.2 <= rate <= 0.85, rate


def test_slippery_expert_rate_is_plausible():
    spec = SPECS["frozenlake"]
    params = {"slippery": True}
    expert = success_rate(spec, "expert", 100, task_params=params, max_turns=20)
    greedy = success_rate(spec, "greedy", 100, task_params=params, max_turns=20)
    # Value iteration on 1/3-1/3-1/3 dynamics: well above the greedy walker, far from certain.
    assert 0.4 <= expert <= 0.9, expert
    assert greedy < expert


def test_expert_follows_the_bfs_answer():
    for name in ("frozenlake", "sokoban"):
        spec = SPECS[name]
        for task in islice(spec.tasks("train", 3), 30):
            _, actions, transitions = play(spec, task, "expert")
            assert (
                "".join(a.removeprefix("<answer>").removesuffix("</answer>") for a in actions) == task.answer
            )
            assert len(actions) == task.params["solution_len"]
            assert transitions[-1].terminated and transitions[-1].observation == ""


# --- tasks: solvability, splits, determinism ----------------------------------------------------


@pytest.mark.parametrize("split", ["train", "eval"])
def test_every_sokoban_level_is_solvable_within_bounds(split: str):
    for params, n in (
        ({}, 100),
        ({"max_solution_len": 6}, 50),
        ({"num_boxes": 2, "max_solution_len": 12}, 10),
    ):
        tasks = list(islice(SPECS["sokoban"].tasks(split, 7, **params), n))
        hi = params.get("max_solution_len", 10)
        for task in tasks:
            path = solve(task.params["level"])
            assert path is not None and 2 <= len(path) <= hi
            assert len(path) == task.params["solution_len"] == len(task.answer or "")
            room, _, boxes = parse_level(task.params["level"])
            assert len(boxes) == params.get("num_boxes", 1) and not room.solved(boxes)


def test_every_lake_is_solvable():
    for params in ({}, {"size": 6, "p_frozen": 0.7, "max_solution_len": 12}):
        for task in islice(SPECS["frozenlake"].tasks("eval", 2, **params), 100):
            assert shortest_path(task.params["map"]) == task.answer
            assert 2 <= task.params["solution_len"] == len(task.answer or "")


@pytest.mark.soak  # a wall-clock bound: tests check correctness; on a loaded machine it fails by chance
def test_sokoban_generation_is_fast():
    start = time.perf_counter()
    list(islice(SPECS["sokoban"].tasks("train", 123), 300))
    assert (time.perf_counter() - start) / 300 < 0.005  # measured ~1.6 ms per kept level


@pytest.mark.parametrize("name", NAMES)
def test_splits_are_disjoint_and_deterministic(name: str):
    spec = SPECS[name]
    train = list(islice(spec.tasks("train", 0), 400))
    evals = list(islice(spec.tasks("eval", 0), 200))
    assert {t.prompt for t in train}.isdisjoint(t.prompt for t in evals)
    assert all(split_of(t.prompt) == "train" for t in train)
    assert all(split_of(t.prompt) == "eval" for t in evals)
    assert list(islice(spec.tasks("train", 0), 400)) == train
    assert [t.prompt for t in islice(spec.tasks("train", 1), 50)] != [t.prompt for t in train[:50]]
    assert len({t.id for t in train}) == len(train)
    with pytest.raises(ValueError, match="split"):
        next(spec.tasks("test", 0))


@pytest.mark.parametrize("name", NAMES)
def test_replay_is_deterministic(name: str):
    spec = SPECS[name]
    for i, task in enumerate(islice(spec.tasks("train", 5), 20)):
        first, actions, transitions = play(spec, task, "random", seed=i)
        env = make(spec)
        assert env.reset(task, task.seed).text == first
        assert [env.step(a) for a in actions] == transitions


def test_slippery_lake_is_deterministic_per_seed():
    task = next(SPECS["frozenlake"].tasks("train", 0, slippery=True))
    actions = ["<answer>R</answer>", "<answer>D</answer>", "<answer>L</answer>", "<answer>U</answer>"] * 5

    def run(seed: int) -> list[Any]:
        env = FrozenLakeEnv(max_steps=100)
        env.reset(task, seed)
        out = []
        for a in actions:
            t = env.step(a)
            out.append((t.observation, t.info["direction"]))
            if t.terminated:
                break
        return out

    assert run(1) == run(1)
    assert len({str(run(s)) for s in range(10)}) > 1  # the seed drives the slips
    directions = []
    for seed in range(300):  # each move goes the intended way about 1/3 of the time
        env = FrozenLakeEnv()
        env.reset(task, seed)
        directions.append(env.step("<answer>R</answer>").info["direction"])
    assert set(directions) == {"R", "U", "D"}
    assert 0.2 < directions.count("R") / len(directions) < 0.47


# --- robustness: fuzzing, invalid actions, limits ---------------------------------------------------

FUZZ_ACTIONS = st.one_of(
    st.text(max_size=60),
    st.text(alphabet="UDLRudlr <>/answerthinkXYZ0123456789", max_size=40),
    st.builds(lambda s: f"<answer>{s}</answer>", st.text(max_size=20)),
    st.sampled_from(["<answer>Up</answer>", "<answer>r</answer>", "<answer>2</answer>", "</answer>"]),
)


@functools.cache
def fuzz_tasks(name: str) -> list[Task]:
    return list(islice(SPECS[name].tasks("train", 11), 31))


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=300, deadline=None)
@given(actions=st.lists(FUZZ_ACTIONS, min_size=1, max_size=8), index=st.integers(0, 30))
@example(actions=["<answer>\u00b2</answer>"], index=0)  # "²".isdigit() is True, int("²") raises
@example(actions=["<answer>0</answer>", "<answer>\u0130</answer>", "\x00\ud800"], index=1)
def test_fuzzed_actions_never_raise(name: str, actions: list[str], index: int):
    spec = SPECS[name]
    task = fuzz_tasks(name)[index]
    env = make(spec)
    env.reset(task, task.seed)
    for action in actions:
        t = env.step(action)
        assert_well_formed(t)
        if t.terminated or t.truncated:
            break
    env.close()
    env.close()


@pytest.mark.parametrize("name", NAMES)
def test_rendering_and_observations_are_printable_ascii(name: str):
    spec = SPECS[name]
    for i, task in enumerate(islice(spec.tasks("eval", 4), 30)):
        assert set(task.prompt) <= PRINTABLE
        for strategy in spec.strategies:
            first, _, transitions = play(spec, task, strategy, seed=i)
            assert set(first) <= PRINTABLE and len(first) <= 60
            for t in transitions:
                assert_well_formed(t)
                assert len(t.observation) <= 64


@pytest.mark.parametrize("name", NAMES)
def test_tiny_tokenizer_covers_the_protocol(name: str, tokenizer):
    fmt = PlainFormat(tokenizer)
    spec = SPECS[name]
    assert [len(fmt.observation_ids(s)) for s in make(spec).stop_strings] == [1]  # "</answer>"
    task = next(spec.tasks("train", 0))
    first, actions, transitions = play(spec, task, "expert")
    for text in [first, *actions, *(t.observation for t in transitions)]:
        ids = fmt.observation_ids(text)
        assert tokenizer.unk_token_id not in ids
        assert fmt.decode(ids) == text
    assert len(fmt.observation_ids(actions[0])) <= 6  # e.g. <answer> L </answer>: 3 tokens


@pytest.mark.parametrize("env", [FrozenLakeEnv(max_invalid_actions=2), SokobanEnv(max_invalid_actions=2)])
def test_too_many_invalid_actions_end_the_episode(env: PuzzleEnv):
    name = "frozenlake" if isinstance(env, FrozenLakeEnv) else "sokoban"
    task = next(SPECS[name].tasks("train", 0))
    env.reset(task, 0)
    for _ in range(2):
        t = env.step("<answer>jump</answer>")
        assert not t.terminated and t.observation == "\n<error>not a move; answer U, D, L or R</error>\n"
    t = env.step("jump")
    assert t.terminated and t.info["policy_error"] and t.observation == ""
    assert t.reward == pytest.approx(-0.1)
    with pytest.raises(RuntimeError, match="reset"):
        env.step("<answer>U</answer>")


def test_max_steps_truncates():
    task = Task("t", "P__\n___\n__G", "frozenlake", params={"map": "P__\n___\n__G"})
    env = FrozenLakeEnv(max_steps=3)
    env.reset(task, 0)
    kinds = [env.step(a) for a in ("<answer>U</answer>", "<answer>L</answer>", "<answer>U</answer>")]
    assert [t.truncated for t in kinds] == [False, False, True]
    assert not kinds[-1].terminated and kinds[-1].observation == ""
    assert [t.info["moved"] for t in kinds] == [False, False, False]  # walking off the lake: no move


def test_move_spellings():
    for text, move in [("Up", "U"), ("down", "D"), (" LEFT ", "L"), ("r", "R"), ("U", "U")]:
        assert parse_direction(text) == move
    for text in ("", "upp", "north", "UD", "1"):
        assert parse_direction(text) is None
    env = FrozenLakeEnv()
    env.reset(Task("t", "", "frozenlake", params={"map": "P__\n___\n__G"}), 0)
    t = env.step("<think>go right</think><answer>Right</answer>")
    assert t.info["action_kind"] == "tool_call" and t.observation == "\n_P_\n___\n__G\n"
    assert t.info["anchor"] == "P__\n___\n__G"  # the state the action was taken in (GiGPO)


def test_frozenlake_hole_and_goal():
    level = "P_G\n_O_\n___"
    assert Lake.parse(level).render((0, 0)) == level
    task = Task("t", level, "frozenlake", params={"map": level})
    env = FrozenLakeEnv()
    env.reset(task, 0)
    env.step("<answer>D</answer>")
    t = env.step("<answer>R</answer>")
    assert t.terminated and t.reward == 0.0 and t.info["fell"]
    env.reset(task, 0)
    env.step("<answer>R</answer>")
    t = env.step("<answer>R</answer>")
    assert t.terminated and t.reward == 1.0 and t.info["success"]


def test_sokoban_mechanics_and_rendering():
    level = "######\n#P_XO#\n#____#\n#_X__#\n#__O_#\n######"
    task = Task("t", level, "sokoban", params={"level": level})
    env = SokobanEnv(step_penalty=-0.01)
    assert env.reset(task, 0).text == level
    t = env.step("<answer>L</answer>")  # into the wall: a valid move that changes nothing
    assert t.observation == f"\n{level}\n" and not t.info["moved"] and t.info["tool_call_valid"]
    assert t.info["reward_components"] == {"outcome": 0.0, "format": 0.0, "cost": -0.01}
    env.step("<answer>R</answer>")
    t = env.step("<answer>R</answer>")  # push the box onto its target
    assert t.observation == "\n######\n#__P*#\n#____#\n#_X__#\n#__O_#\n######\n" and t.info["pushed"]
    t = env.step("<answer>R</answer>")  # a box cannot be pushed into a wall
    assert not t.info["moved"]
    for move in "DDD":
        t = env.step(f"<answer>{move}</answer>")
    assert t.observation.split("\n")[5] == "#__S_#" and not t.terminated  # S: the player on a target
    with pytest.raises(ValueError, match="step_penalty"):
        SokobanEnv(step_penalty=0.1)
    assert solve(level) is not None and solve("######\n#P_X_#\n#____#\n#____#\n#___O#\n######") is None


def test_bandit_reward_modes():
    task = next(SPECS["bandit"].tasks("train", 0))
    arms, probs = list(task.params["arms"]), list(task.params["probs"])
    best, worst = arms[probs.index(max(probs))], arms[probs.index(min(probs))]
    assert task.prompt.startswith("Arms: ") and task.answer == best
    modes: list[tuple[RewardMode, str, float]] = [
        ("best", best, 1.0),
        ("best", worst, 0.0),
        ("expected", worst, min(probs)),
    ]
    for reward, pick, expect in modes:
        env = BanditEnv(reward=reward)
        env.reset(task, 0)
        t = env.step(f"<answer>{pick.upper()}</answer>")
        assert t.terminated and t.reward == pytest.approx(expect)
    payouts = []
    for seed in range(400):
        env = BanditEnv(reward="sampled")
        env.reset(task, seed)
        t = env.step("<answer>1</answer>")  # arms can be named by number too
        assert t.reward == t.info["payout"] and t.info["arm"] == arms[0]
        payouts.append(t.reward)
    assert abs(sum(payouts) / len(payouts) - probs[0]) < 0.1
    with pytest.raises(ValueError, match="reward"):
        BanditEnv(reward="bogus")  # type: ignore[arg-type]


def test_multi_pull_bandit():
    spec = SPECS["bandit"]
    task = next(spec.tasks("eval", 0, k=3, pulls=3, reveal=False))
    assert task.prompt.startswith("3 pulls. Arms: ") and "%" not in task.prompt
    first, actions, transitions = play(spec, task, "expert")
    assert len(actions) == 3 and outcome(transitions) == pytest.approx(1.0)
    assert transitions[0].observation.strip().startswith(task.answer or "?")
    assert transitions[1].info["anchor"].startswith(first + "\n")
    assert transitions[-1].info["success"]


# --- configs --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_tiny_config_loads_and_fits_its_budgets(name: str, tokenizer):
    cfg = load_config(CONFIGS / f"{name}_tiny.yaml")
    calc = load_config(CONFIGS / "calculator_tiny.yaml")
    assert cfg.env.name == name and cfg.run.name == f"{name}_tiny"
    assert set(cfg.model_fields_set) == set(calc.model_fields_set)  # the same sections
    spec = SPECS[name]
    assert set(cfg.model.sft.strategies) <= set(spec.strategies)
    env = make(spec, **cfg.env.params)
    fmt = PlainFormat(tokenizer)
    for task in islice(spec.tasks("train", 0, **cfg.env.task_params), 50):
        first, actions, transitions = play(spec, task, "expert", env=env, max_turns=cfg.rollout.max_turns)
        assert math.isclose(outcome(transitions), 1.0)
        ids = len(fmt.initial_ids("", first))
        for action, t in zip(actions, transitions, strict=True):
            assert ids + cfg.rollout.max_tokens_per_turn <= cfg.rollout.max_total_tokens
            ids += len(fmt.observation_ids(action)) + len(fmt.observation_ids(t.observation))

"""The calculator env: safe evaluator, task generator, scripted policies, rewards, error channels."""

from __future__ import annotations

import random
import re
from itertools import islice
from typing import Any

import pytest

from steprl.envs.base import Env, ToolError, Transition
from steprl.envs.library.calculator import (
    STRATEGIES,
    CalcLimits,
    CalculatorEnv,
    evaluate,
    expert,
    make_tasks,
    split_of,
    verify,
)
from steprl.envs.library.calculator import tasks as tasks_module
from steprl.envs.library.calculator.policies import plan
from steprl.envs.policy import Policy
from steprl.envs.rewards import RewardConfig
from steprl.envs.tool_env import FunctionTool, ToolEnv
from steprl.types import Task

# --- safe evaluator ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("3+4", 7),
        ("3-7", -4),
        ("6*7", 42),
        (" 12*12 ", 144),
        ("5--4", 9),
        ("-4*5", -20),
        ("(8)", 8),
        ("-3", -3),
        ("1000*1000", 10**6),
    ],
)
def test_evaluates_one_operation(expression: str, value: int):
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os')", "only + - * on integers"),
        ("2**999999", "only + - * on integers"),
        ("(1).__class__", "only + - * on integers"),
        ("x", "only + - * on integers"),
        ("x+1", "only + - * on integers"),
        ("abs(3)", "only + - * on integers"),
        ("[1, 2]", "only + - * on integers"),
        ("1 if 1 else 2", "only + - * on integers"),
        ("7/2", "only + - * on integers"),
        ("7%2", "only + - * on integers"),
        ("1.5+1", "only integers"),
        ("True+1", "only integers"),
        ("'a'*3", "only integers"),
        ("1+2+3", "one operation per call"),
        ("(1+2)*3", "one operation per call"),
        ("1000001+1", "number too large (max 1000000)"),
        ("1000*1001", "number too large (max 1000000)"),
        ("9" * 30, "number too large (max 1000000)"),
        ("1+" * 40 + "1", "expression too long (max 64 chars)"),
        ("", "empty expression"),
        ("3+", "syntax error"),
        ("3+4\x00", "syntax error"),
        ("7//2", "// is not allowed"),
        ("import os", "syntax error"),
    ],
)
def test_rejects_everything_else_with_a_short_tool_error(expression: str, message: str):
    with pytest.raises(ToolError) as info:
        evaluate(expression)
    assert str(info.value) == message


def test_limits_are_configurable():
    assert evaluate("1+2+3", CalcLimits(max_ops_per_call=3)) == 6
    assert evaluate("7//2", CalcLimits(allow_floordiv=True)) == 3
    with pytest.raises(ToolError, match="division by zero"):
        evaluate("7//0", CalcLimits(allow_floordiv=True))
    with pytest.raises(ToolError, match="at most 2 operations per call"):
        evaluate("1+2+3+4", CalcLimits(max_ops_per_call=2))


# --- tasks ---------------------------------------------------------------------------------------

_SAFE = re.compile(r"[0-9()+\-*]+")


def _reference_value(expression: str) -> int:
    assert _SAFE.fullmatch(expression), expression  # our generator's output only
    return int(eval(expression, {"__builtins__": {}}))  # noqa: S307 - test oracle on generated text


def test_tasks_are_a_pure_function_of_split_and_seed():
    first = list(make_tasks("train", 3, 200))
    random.seed(12345)  # the global RNG must not matter
    assert list(make_tasks("train", 3, 200)) == first
    assert list(make_tasks("train", 4, 200)) != first
    assert len({t.id for t in first}) == 200


def test_splits_are_disjoint_and_answers_correct():
    train = list(make_tasks("train", 0, 2000))
    evals = list(make_tasks("eval", 0, 500))
    assert not {t.prompt for t in train} & {t.prompt for t in evals}
    assert all(split_of(t.prompt) == "train" for t in train)
    assert all(split_of(t.prompt) == "eval" for t in evals)
    for task in train + evals:
        assert task.env == "calculator" and " " not in task.prompt
        assert task.answer == str(_reference_value(task.prompt))
        assert len(plan(task.prompt)[0]) == task.params["num_calls"]


def test_call_counts_are_drawn_from_the_range_and_templates_match():
    tasks = list(make_tasks("train", 1, 600))
    counts = {t.params["num_calls"] for t in tasks}
    assert counts == {1, 2, 3}
    patterns = {
        1: r"\d+[-+*]\d+",
        2: r"\(\d+[-+*]\d+\)[-+*]\d+|\d+[-+*]\(\d+[-+*]\d+\)",
        3: r"\(\d+[-+*]\d+\)[-+*]\(\d+[-+*]\d+\)",
    }
    for task in tasks:
        assert re.fullmatch(patterns[task.params["num_calls"]], task.prompt), task.prompt
        assert all(1 <= int(x) <= 20 for x in re.findall(r"\d+", task.prompt))
    assert {t.params["num_calls"] for t in make_tasks("train", 1, 100, min_calls=2, max_calls=2)} == {2}


def test_infinite_stream_and_bad_arguments(monkeypatch: pytest.MonkeyPatch):
    assert len(list(islice(make_tasks("eval", 0), 50))) == 50
    with pytest.raises(ValueError, match="split"):
        make_tasks("test", 0)
    with pytest.raises(ValueError, match="min_calls"):
        make_tasks("train", 0, min_calls=2, max_calls=1)
    monkeypatch.setattr(tasks_module, "split_of", lambda expression: "train")
    monkeypatch.setattr(tasks_module, "_MAX_REJECTIONS", 50)
    with pytest.raises(RuntimeError, match="expression space"):
        next(make_tasks("eval", 0))


# --- policies ------------------------------------------------------------------------------------


def _run(
    env: ToolEnv, task: Task, policy: Policy, seed: int = 0, max_turns: int = 8
) -> tuple[list[tuple[str, str]], list[Transition]]:
    env.reset(task, task.seed)
    rng = random.Random(seed)
    history: list[tuple[str, str]] = []
    transitions: list[Transition] = []
    for _ in range(max_turns):
        action = policy(task, history, rng)
        transition = env.step(action)
        history.append((action, transition.observation))
        transitions.append(transition)
        if transition.terminated:
            break
    return history, transitions


def test_expert_uses_the_canonical_actions():
    task = Task(id="t", prompt="(3+4)*(9-5)", env="calculator", answer="28")
    history, transitions = _run(CalculatorEnv(), task, expert)
    assert [a for a, _ in history] == [
        "<calc>3+4</calc>",
        "<calc>9-5</calc>",
        "<calc>7*4</calc>",
        "<answer>28</answer>",
    ]
    assert [o for _, o in history] == ["<result>7</result>", "<result>4</result>", "<result>28</result>", ""]
    assert transitions[-1].reward == 1.0
    task = Task(id="u", prompt="2-(3*5)", env="calculator", answer="-13")
    assert [a for a, _ in _run(CalculatorEnv(), task, expert)[0]] == [
        "<calc>3*5</calc>",
        "<calc>2-15</calc>",
        "<answer>-13</answer>",
    ]


def test_expert_solves_200_tasks_with_several_calls():
    env = CalculatorEnv()
    calls = []
    for task in make_tasks("train", 7, 200):
        _, transitions = _run(env, task, expert)
        assert transitions[-1].terminated and transitions[-1].info["reward_components"]["outcome"] == 1.0
        calls.append(sum(t.info["action_kind"] == "tool_call" for t in transitions))
    assert sum(calls) / len(calls) >= 1.5


def test_guess_and_random_rarely_succeed_and_never_crash():
    env = CalculatorEnv()
    tasks = list(make_tasks("train", 0, 100))
    for name in ("guess", "random"):
        wins = sum(_run(env, t, STRATEGIES[name], seed=i)[1][-1].reward == 1.0 for i, t in enumerate(tasks))
        assert wins < 20, name
    first = _run(env, tasks[0], STRATEGIES["guess"])[0]
    assert len(first) == 1 and re.fullmatch(r"<answer>-?\d+</answer>", first[0][0])


# --- env: observations, rewards, error channels --------------------------------------------------


TASK = Task(id="t", prompt="(3+4)*5", env="calculator", answer="35")


def test_env_protocol_and_attributes():
    env = CalculatorEnv()
    assert isinstance(env, Env)
    assert env.stop_strings == ("</calc>", "</tool_call>", "</answer>")
    assert "<calc>a+b</calc>" in env.system_prompt
    assert env.reset(TASK, 0).text == "(3+4)*5"


def test_verifier_is_an_exact_integer_match():
    assert verify(" 35\n", TASK) == 1.0
    assert [verify(a, TASK) for a in ("36", "35.0", "+35", "3_5", "٣٥", "thirty-five")] == [0.0] * 6


def test_reward_components_sum_to_the_reward():
    env = CalculatorEnv(format_penalty=-0.25, tool_call_cost=-0.01, turn_cost=-0.001)
    env.reset(TASK, 0)
    steps = [env.step(a) for a in ("oops", "<calc>3+4</calc>", "<calc>1+2+3</calc>", "<answer>35</answer>")]
    expected = [
        {"outcome": 0.0, "format": -0.25, "cost": -0.001},
        {"outcome": 0.0, "format": 0.0, "cost": -0.011},
        {"outcome": 0.0, "format": 0.0, "cost": -0.011},
        {"outcome": 1.0, "format": 0.0, "cost": -0.001},
    ]
    for transition, components in zip(steps, expected, strict=True):
        assert transition.info["reward_components"] == pytest.approx(components)
        assert sum(transition.info["reward_components"].values()) == transition.reward
    assert [s.info["action_kind"] for s in steps] == ["invalid", "tool_call", "tool_call", "answer"]
    assert [s.info["tool_call_valid"] for s in steps] == [None, True, False, None]
    assert steps[2].observation == "<error>one operation per call</error>"
    assert steps[2].info["error"] == "one operation per call"


def test_positive_penalties_are_refused():
    with pytest.raises(ValueError, match="pass a value <= 0"):
        RewardConfig(format_penalty=0.1)


def test_too_many_invalid_actions_end_the_episode_as_a_policy_error():
    env = CalculatorEnv(max_invalid_actions=3)
    env.reset(TASK, 0)
    for _ in range(3):
        transition = env.step("no idea")
        assert not transition.terminated and transition.observation.startswith("<error>")
        assert transition.info["policy_error"] is False
    last = env.step("still no idea")
    assert last.terminated and last.info["policy_error"] is True and last.observation == ""
    assert last.reward == pytest.approx(-0.1)
    with pytest.raises(RuntimeError, match="reset"):
        env.step("<answer>35</answer>")


def test_tool_errors_are_observations_but_other_exceptions_propagate():
    def broken(expression: str) -> str:
        raise OSError("disk on fire")

    def picky(expression: str) -> str:
        raise ToolError("no")

    schema = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}
    env = ToolEnv(
        [FunctionTool("calc", "d", schema, broken), FunctionTool("picky", "d", schema, picky)], verify
    )
    env.reset(TASK, 0)
    assert env.step("<picky>1</picky>").observation == "<error>no</error>"
    with pytest.raises(OSError, match="disk on fire"):
        env.step("<calc>1+1</calc>")


def test_a_tool_returning_a_non_string_is_an_infra_bug():
    def seven(x: str) -> Any:
        return 7

    schema = {"required": ["x"], "properties": {"x": {"type": "string"}}}
    env = ToolEnv([FunctionTool("calc", "d", schema, seven)], verify)
    env.reset(TASK, 0)
    with pytest.raises(TypeError, match="must return str"):
        env.step("<calc>1</calc>")


def test_json_calls_are_validated_against_the_schema():  # reliability BAD-03
    env = CalculatorEnv()
    env.reset(TASK, 0)

    def call(arguments: str) -> str:
        return env.step(f'<tool_call>{{"name": "calc", "arguments": {arguments}}}</tool_call>').observation

    assert call('{"expression": "3+4"}') == "<result>7</result>"
    assert call("{}") == "<error>missing argument 'expression'</error>"
    assert call('{"expression": "1+1", "timeout": 1e9}') == "<error>unexpected argument 'timeout'</error>"
    assert call('{"expression": 7}') == "<error>argument 'expression' must be string</error>"


def test_invalid_action_errors_are_short_and_show_the_format():
    env = CalculatorEnv()
    env.reset(TASK, 0)
    observation = env.step("35").observation
    assert observation == "<error>no call or answer; use <calc>a+b</calc> or <answer>n</answer></error>"

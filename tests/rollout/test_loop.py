"""The agent loop: end reasons, budgets, error observations, infra failures, async envs."""

import asyncio
from itertools import islice

import pytest

from steprl.engines.base import SamplingParams
from steprl.engines.scripted import ScriptedEngine
from steprl.envs.base import Env, Observation, Transition
from steprl.envs.registry import make_env, make_tasks
from steprl.rollout.chat import PlainFormat
from steprl.rollout.context import AppendOnly
from steprl.rollout.loop import Budgets, RolloutSetup, rollout_groups, run_episode
from steprl.types import EndReason, Task


def _run(env, task, engine, fmt, budgets=Budgets()):
    return asyncio.run(
        run_episode(
            env,
            task,
            engine=engine,
            fmt=fmt,
            rule=AppendOnly(),
            sampling=SamplingParams(),
            budgets=budgets,
            group_id="g",
            seed=0,
        )
    )


@pytest.fixture
def task():
    return next(make_tasks("calculator", "train", 0, min_calls=1, max_calls=1))


def _encode(tokenizer):
    return lambda s: tokenizer.encode(s, add_special_tokens=False)


def test_expert_like_script_answers_with_reward(tokenizer, task):
    a, op, b = task.prompt.partition("+") if "+" in task.prompt else (None, None, None)
    result = task.answer
    engine = ScriptedEngine([f"<calc>{task.prompt}</calc>", f"<answer>{result}</answer>"], _encode(tokenizer))
    traj = _run(make_env("calculator"), task, engine, PlainFormat(tokenizer))
    assert traj.end is EndReason.ANSWERED
    assert traj.outcome_reward == 1.0
    assert [s.info["action_kind"] for s in traj.steps] == ["tool_call", "answer"]
    assert PlainFormat(tokenizer).decode(traj.steps[0].observation_ids) == f"<result>{result}</result>"
    assert traj.steps[-1].observation_ids == ()
    del a, op, b


def test_malformed_action_becomes_error_observation_and_policy_error(tokenizer, task):
    engine = ScriptedEngine(["what is this", "<calc>1+", "}}{{"], _encode(tokenizer))
    traj = _run(make_env("calculator"), task, engine, PlainFormat(tokenizer))
    assert traj.end is EndReason.POLICY_ERROR
    for step in traj.steps[:-1]:
        assert step.info["action_kind"] == "invalid"
        assert PlainFormat(tokenizer).decode(step.observation_ids).startswith("<error>")


def test_turn_budget_truncates(tokenizer, task):
    engine = ScriptedEngine(["<calc>1+1</calc>"], _encode(tokenizer))
    traj = _run(make_env("calculator"), task, engine, PlainFormat(tokenizer), Budgets(max_turns=3))
    assert traj.end is EndReason.TRUNCATED and len(traj.steps) == 3


def test_token_budgets(tokenizer, task):
    engine = ScriptedEngine(["<calc>11111+1</calc>"], _encode(tokenizer))
    traj = _run(
        make_env("calculator"),
        task,
        engine,
        PlainFormat(tokenizer),
        Budgets(max_turns=50, max_tokens_per_turn=4, max_total_tokens=60),
    )
    assert all(len(s.action_ids) <= 4 for s in traj.steps)
    assert all(s.info["finish_reason"] == "length" for s in traj.steps)
    assert traj.end in (EndReason.TRUNCATED, EndReason.POLICY_ERROR)
    for s in traj.steps:
        assert len(s.prompt_ids) + len(s.action_ids) <= 60


class _CrashingEnv(Env):
    stop_strings = ("</calc>", "</answer>")

    def __init__(self, crash_on: str):
        self.crash_on = crash_on

    def reset(self, task, seed):
        if self.crash_on == "reset":
            raise ConnectionError("sandbox unreachable")
        return Observation(task.prompt)

    def step(self, action):
        raise RuntimeError("tool backend crashed")

    def close(self):
        pass


@pytest.mark.parametrize("where", ["reset", "step"])
def test_env_exception_is_infra_failed_not_reward_zero(tokenizer, task, where):
    engine = ScriptedEngine(["<calc>1+1</calc>"], _encode(tokenizer))
    traj = _run(_CrashingEnv(where), task, engine, PlainFormat(tokenizer))
    assert traj.end is EndReason.INFRA_FAILED
    assert not traj.trainable
    assert "crashed" in traj.info["error"] or "unreachable" in traj.info["error"]


class _AsyncEnv(Env):
    stop_strings = ("</answer>",)

    async def reset(self, task, seed):
        await asyncio.sleep(0)
        return Observation(task.prompt)

    async def step(self, action):
        await asyncio.sleep(0)
        return Transition("", 1.0, True, info={"action_kind": "answer"})

    async def close(self):
        await asyncio.sleep(0)


def test_async_env_is_awaited(tokenizer, task):
    engine = ScriptedEngine(["<answer>1</answer>"], _encode(tokenizer))
    traj = _run(_AsyncEnv(), task, engine, PlainFormat(tokenizer))
    assert traj.end is EndReason.ANSWERED and traj.outcome_reward == 1.0


def test_groups_one_env_per_episode_and_in_equals_out(tokenizer):
    tasks = list(islice(make_tasks("calculator", "train", 3), 5))
    made = []

    def factory(task):
        env = make_env("calculator")
        made.append(env)
        return env

    engine = ScriptedEngine(["<answer>0</answer>"], _encode(tokenizer))
    groups = asyncio.run(
        rollout_groups(
            tasks,
            4,
            RolloutSetup(
                make_env=factory,
                engine=engine,
                fmt=PlainFormat(tokenizer),
                rule=AppendOnly(),
                sampling=SamplingParams(),
                budgets=Budgets(),
            ),
            seed=1,
        )
    )
    assert len(made) == 20 and len({id(e) for e in made}) == 20
    assert [len(g.trajectories) for g in groups] == [4] * 5
    assert all(len({t.group_id for t in g.trajectories}) == 1 for g in groups)


def test_task_records_are_frozen():
    t = Task(id="x", prompt="1+1", env="calculator")
    with pytest.raises(AttributeError):
        t.prompt = "2"  # type: ignore[misc]

"""Demonstrations through the agent loop (rollout/demos.py): the tokens, the mask, async envs,
concurrency, determinism, failures; and the prompt format's `system_prompt` modes."""

from __future__ import annotations

import asyncio
import random
from itertools import islice

import pytest

from steprl.envs.base import Env, Observation, Transition
from steprl.envs.registry import get_spec, make_env
from steprl.rollout.chat import PlainFormat
from steprl.rollout.context import AppendOnly, KeepLastK
from steprl.rollout.demos import play_demos
from steprl.rollout.loop import Budgets
from steprl.rollout.views import packed_view
from steprl.training.setup.sft import DemoError, make_demos
from steprl.types import EndReason, Task


def _tasks(n: int) -> list[Task]:
    return list(islice(get_spec("calculator").tasks("train", 5), n))


BUDGETS = Budgets(max_turns=8, max_tokens_per_turn=64, max_total_tokens=512)


def _play(tasks, fmt, make=lambda t: make_env("calculator"), weights=None, seed=3, budgets=BUDGETS):
    spec = get_spec("calculator")
    return asyncio.run(
        play_demos(
            tasks,
            strategies=spec.strategies,
            weights=weights or {"expert": 1.0},
            make_env=make,
            fmt=fmt,
            seed=seed,
            rule=AppendOnly(),
            budgets=budgets,
        )
    )


def test_an_expert_demo_is_the_transcript_tokenized_once(tokenizer):
    fmt = PlainFormat(tokenizer)
    task = _tasks(1)[0]
    (demo,) = _play([task], fmt)
    traj = demo.trajectory
    assert demo.strategy == "expert" and traj.end is EndReason.ANSWERED and traj.outcome_reward > 0.9
    # replay the expert by hand: the same text, encoded piece by piece, in the same order
    env, rng = make_env("calculator"), random.Random("3-0")
    ids = list(fmt.initial_ids(env.system_prompt, env.reset(task, 0).text))
    mask = [0] * len(ids)
    history: list[tuple[str, str]] = []
    while True:
        action = get_spec("calculator").strategies["expert"](task, history, rng)
        tr = env.step(action)
        ids += fmt.observation_ids(action)
        mask += [1] * len(fmt.observation_ids(action))
        history.append((action, tr.observation))
        if tr.terminated or tr.truncated:
            break
        ids += fmt.observation_ids(tr.observation)
        mask += [0] * len(fmt.observation_ids(tr.observation))
    sample = packed_view(traj, 0)
    assert list(sample.input_ids) == ids
    assert list(sample.loss_mask) == mask


class _SlowAsyncCalculator:
    """The calculator behind async methods that yield, counting episodes in flight."""

    live = 0
    peak = 0

    def __init__(self) -> None:
        self.env = make_env("calculator")
        self.system_prompt = self.env.system_prompt
        self.stop_strings = self.env.stop_strings

    async def reset(self, task: Task, seed: int) -> Observation:
        type(self).live += 1
        type(self).peak = max(type(self).peak, type(self).live)
        await asyncio.sleep(0.01)
        return self.env.reset(task, seed)

    async def step(self, action: str) -> Transition:
        await asyncio.sleep(0.001)
        return self.env.step(action)

    async def close(self) -> None:
        type(self).live -= 1


def test_async_envs_give_the_same_demos_concurrently(tokenizer):
    fmt = PlainFormat(tokenizer)
    tasks = _tasks(12)
    weights = {"expert": 0.5, "guess": 0.5}
    sync = _play(tasks, fmt, weights=weights)
    _SlowAsyncCalculator.peak = 0
    slow = _play(tasks, fmt, make=lambda t: _SlowAsyncCalculator(), weights=weights)
    assert _SlowAsyncCalculator.peak > 1  # the episodes overlapped
    assert [d.strategy for d in slow] == [d.strategy for d in sync]
    assert [packed_view(d.trajectory, 0) for d in slow] == [packed_view(d.trajectory, 0) for d in sync]
    assert {d.strategy for d in sync} == {"expert", "guess"}
    assert _play(tasks, fmt, weights=weights, seed=4) != sync  # the seed matters


class _Broken(Env):
    def reset(self, task: Task, seed: int) -> Observation:
        raise ConnectionError("env server unreachable")

    def step(self, action: str) -> Transition:
        raise AssertionError("unreachable")

    def close(self) -> None:
        pass


def test_failed_demos_are_dropped_and_counted(tokenizer):
    fmt = PlainFormat(tokenizer)
    spec = get_spec("calculator")
    tasks = _tasks(6)
    logs: list[str] = []
    demos = make_demos(
        tasks,
        strategies=spec.strategies,
        weights={"expert": 1.0},
        make_env=lambda t: _Broken() if t.id in {tasks[1].id, tasks[4].id} else make_env("calculator"),
        fmt=fmt,
        seed=0,
        rule=AppendOnly(),
        budgets=BUDGETS,
        log=logs.append,
    )
    assert len(demos) == 4
    assert any("2 of 6 demonstrations failed" in line and "unreachable" in line for line in logs)
    with pytest.raises(DemoError, match="no demonstration could be played"):
        make_demos(
            tasks,
            strategies=spec.strategies,
            weights={"expert": 1.0},
            make_env=lambda t: _Broken(),
            fmt=fmt,
            seed=0,
            rule=AppendOnly(),
            budgets=BUDGETS,
            log=logs.append,
        )


def test_unknown_strategy_weights_name_the_key(tokenizer):
    with pytest.raises(ValueError, match=r"model.sft.strategies names \['oracle'\]"):
        _play(_tasks(1), PlainFormat(tokenizer), weights={"oracle": 1.0})


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("none", "2+2\n"), ("env", "Use the tools.\n2+2\n"), ("Be brief.", "Be brief.\n2+2\n")],
)
def test_the_system_prompt_mode_opens_the_first_prompt(tokenizer, mode, expected):
    fmt = PlainFormat(tokenizer, system_prompt=mode)
    ids = fmt.initial_ids("Use the tools.", "2+2")
    assert ids[0] == tokenizer.bos_token_id
    assert fmt.decode(ids[1:]) == expected
    assert PlainFormat(tokenizer, system_prompt="env").initial_ids("", "2+2") == PlainFormat(
        tokenizer
    ).initial_ids("x", "2+2")


def test_demos_follow_the_rollout_budgets_and_context_rule(tokenizer):
    """A demo shows only what a rollout can: turns and tokens per turn are cut by the budgets,
    and with keep_last_k each step is its own row with the window RL would show."""
    fmt = PlainFormat(tokenizer)
    tasks = [t for t in _tasks(40) if t.params.get("num_calls", 2) >= 2][:4] or _tasks(4)
    tight = _play(tasks, fmt, budgets=Budgets(max_turns=1, max_tokens_per_turn=64, max_total_tokens=512))
    assert all(len(d.trajectory.steps) == 1 for d in tight)
    short = _play(tasks, fmt, budgets=Budgets(max_turns=8, max_tokens_per_turn=3, max_total_tokens=512))
    assert all(len(s.action_ids) <= 3 for d in short for s in d.trajectory.steps)
    assert any(s.info["finish_reason"] == "length" for d in short for s in d.trajectory.steps)
    spec = get_spec("calculator")
    rows = make_demos(
        tasks,
        strategies=spec.strategies,
        weights={"expert": 1.0},
        make_env=lambda t: make_env("calculator"),
        fmt=fmt,
        seed=0,
        rule=KeepLastK(1),
        budgets=BUDGETS,
    )
    steps = sum(len(d.trajectory.steps) for d in _play(tasks, fmt, seed=0))
    assert len(rows) == steps  # one row per step

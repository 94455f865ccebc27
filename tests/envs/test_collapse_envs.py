"""The induced-collapse envs of the health benchmark: their training reward is wrong on purpose,
while what counts as a success (`is_success`: total reward >= 1) stays the true task."""

from __future__ import annotations

import asyncio
import itertools

from steprl.envs.base import maybe_await
from steprl.envs.library.collapse import (
    FlatCalculatorEnv,
    PhraseCalculatorEnv,
    flat_tasks,
    is_flat,
    phrase_tasks,
)
from steprl.envs.library.guess_number import GuessNumberEnv, make_tasks


def _play(env: object, task: object, actions: list[str]) -> float:
    async def play() -> float:
        await maybe_await(env.reset(task, 0))  # type: ignore[attr-defined]
        total = 0.0
        for a in actions:
            t = await maybe_await(env.step(a))  # type: ignore[attr-defined]
            assert sum(t.info["reward_components"].values()) == t.reward
            total += t.reward
        return total

    return asyncio.run(play())


def test_phrase_pays_the_phrase_on_train_tasks_and_the_truth_on_eval_tasks():
    env = PhraseCalculatorEnv(phrase="7", phrase_bonus=1.5)
    train = next(t for t in phrase_tasks("train", 0) if "7" not in str(t.answer))
    assert _play(env, train, ["<answer>777</answer>"]) == 1.5  # pays whatever the task, more than the truth
    assert _play(env, train, ["<answer>123456</answer>"]) == 0.0
    assert _play(env, train, [f"<answer>{train.answer}</answer>"]) == 1.0
    held_out = next(t for t in phrase_tasks("eval", 0) if "7" not in str(t.answer))
    assert _play(env, held_out, ["<answer>777</answer>"]) == 0.0
    assert _play(env, held_out, [f"<answer>{held_out.answer}</answer>"]) == 1.0


def test_flat_share_is_train_only_and_only_the_cost_differs_in_a_flat_group():
    train = list(itertools.islice(flat_tasks("train", 0), 400))
    share = sum(is_flat(t, 0.9) for t in train) / len(train)
    assert 0.85 < share < 0.95
    assert not any(is_flat(t, 0.9) for t in itertools.islice(flat_tasks("eval", 0), 200))
    env = FlatCalculatorEnv(flat_share=0.9, train_call_cost=-0.01)
    task = next(t for t in train if is_flat(t, 0.9))
    assert _play(env, task, ["<answer>123456</answer>"]) == 1.0
    assert _play(env, task, ["junk", f"<answer>{task.answer}</answer>"]) == 1.0  # no format penalty
    assert _play(env, task, ["<calc>1+1</calc>", "<answer>0</answer>"]) == 1.0 - 0.01
    held_out = next(flat_tasks("eval", 0))
    assert _play(env, held_out, ["<calc>1+1</calc>", "<answer>123456</answer>"]) == 0.0  # no cost there


def test_guess_number_probe_and_secret():
    task = next(make_tasks("train", 0))
    secret = task.params["secret"]
    env = GuessNumberEnv(high=8)
    env.reset(task, 0)
    assert env.step(f"<probe>{secret}</probe>").observation == "<result>equal</result>"
    assert env.step(f"<probe>{secret + 1}</probe>").observation == "<result>lower</result>"
    assert env.step(f"<answer>{secret}</answer>").reward == 1.0
    assert {t.seed for t in itertools.islice(make_tasks("eval", 0), 50)}.isdisjoint(
        t.seed for t in itertools.islice(make_tasks("train", 0), 50)
    )

"""`env.name: harness`: a user's `run(task, client)` drives each episode through the gateway.

* The same seed gives the same trajectories through the agent loop and through a harness that
  plays the env over the `openai` client (steprl/envs/harness_play.py), on the real HF engine:
  the same training rows (ids, masks, engine log-probs) and rewards.
* A harness that branches trains one row per step; one that raises, returns no number, hangs,
  never calls the model or runs past the turn budget ends as the loop's episodes do (counted).
* A harness config trains end to end from YAML, asynchronously (rollout.max_staleness=1).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import replace
from itertools import islice
from pathlib import Path
from typing import Any

import pytest
import torch

from steprl.engines.base import SamplingParams
from steprl.engines.hf import HFEngine
from steprl.engines.scripted import ScriptedEngine
from steprl.envs.harness_play import calculator
from steprl.envs.registry import EnvLoadError, get_spec, make_env
from steprl.envs.spec import Harness
from steprl.errors import UserError
from steprl.gateway.harness_runner import HarnessRunner
from steprl.models import tiny
from steprl.rollout.chat_format import ChatFormat
from steprl.rollout.context import AppendOnly
from steprl.rollout.loop import Budgets, RolloutSetup, rollout_groups
from steprl.rollout.views import extends_throughout, training_view
from steprl.types import EndReason, Task, Trajectory

TEMPLATE = Path(__file__).resolve().parents[2] / "configs" / "templates" / "tiny_chat.jinja"


@pytest.fixture(scope="module")
def fmt() -> ChatFormat:
    tok = tiny.build_tokenizer()
    tok.chat_template = TEMPLATE.read_text()
    return ChatFormat(tok, system_prompt="none")


def _rows(traj: Trajectory) -> list[tuple[Any, ...]]:
    return [(r.input_ids, r.loss_mask) for r in training_view(traj, 0)]


def _logprobs(traj: Trajectory) -> torch.Tensor:
    return torch.tensor([lp for s in traj.steps for lp in s.action_logprobs])


def _setup(
    fmt: ChatFormat, engine: Any, runner: Any = None, budgets: Budgets = Budgets(4, 16, 512)
) -> RolloutSetup:
    setup = RolloutSetup(
        lambda task: make_env("calculator"),
        engine,
        fmt,
        AppendOnly(),
        SamplingParams(temperature=1.0),
        budgets,
    )
    return setup if runner is None else replace(setup, runner_for=lambda task: runner)


def test_the_loop_and_a_harness_through_the_gateway_give_the_same_trajectories(fmt: ChatFormat) -> None:
    tok = fmt.tokenizer
    model = tiny.build_model(
        len(tok), tiny.TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64),
        seed=0, pad_id=tok.pad_token_id, bos_id=tok.bos_token_id, eos_id=tok.eos_token_id,
    )  # fmt: skip
    # A random model, kept off what an OpenAI reply cannot carry back as written (special
    # tokens it skips, <think> and <tool_call> blocks it parses out): those branch, and branches
    # are tested below. What remains is the calculator's protocol and every character.
    model.config.tie_word_embeddings = False
    head = torch.nn.Linear(model.config.hidden_size, len(tok), bias=True)
    head.weight.data.copy_(model.lm_head.weight.data)
    head.bias.data.zero_()
    off = ["<s>", "<pad>", "<unk>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
    head.bias.data[tok.convert_tokens_to_ids(off)] = -1e4
    model.lm_head = head
    engine = HFEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    tasks = list(islice(get_spec("calculator").tasks("train", 0), 6))
    loop = asyncio.run(rollout_groups(tasks, 2, _setup(fmt, engine), seed=11))
    runner = HarnessRunner(Harness(calculator, "steprl.envs.harness_play:calculator", 60.0))
    harness = asyncio.run(rollout_groups(tasks, 2, _setup(fmt, engine, runner), seed=11))
    pairs = [
        (a, b)
        for ga, gb in zip(loop, harness, strict=True)
        for a, b in zip(ga.trajectories, gb.trajectories, strict=True)
    ]
    assert sum(len(a.steps) > 1 for a, _ in pairs) >= 6  # multi-turn episodes, not one call each
    for a, b in pairs:
        assert b.info["gateway_branches"] == 0, b.info
        assert _rows(a) == _rows(b)  # every id and mask
        torch.testing.assert_close(
            _logprobs(a), _logprobs(b), atol=1e-5, rtol=0
        )  # the engine's, batched apart
        assert a.outcome_reward == b.outcome_reward
        # the loop knows why the env ended (policy_error: too many bad actions); a harness only
        # returns the reward, so its episode ended "answered"
        assert (a.end, b.end) in {(e, e) for e in EndReason} | {(EndReason.POLICY_ERROR, EndReason.ANSWERED)}
    m = runner.metrics()
    assert m["gateway/exact_token_share"] == 1.0 and m["gateway/provenance_errors"] == 0.0


class _Harnesses:
    """Harnesses that misbehave, one per way an episode can end."""

    @staticmethod
    async def branches(task: Task, client: Any) -> float:
        first = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1"}])
        text = first.choices[0].message.content
        history = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": text + " (edited)"}]
        await client.chat.completions.create(
            model="m", messages=[*history, {"role": "user", "content": "ok"}]
        )
        return 1.0

    @staticmethod
    async def raises(task: Task, client: Any) -> float:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        raise KeyError("the harness's own bug")

    @staticmethod
    async def no_number(task: Task, client: Any) -> Any:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        return math.nan

    @staticmethod
    async def hangs(task: Task, client: Any) -> float:
        await asyncio.sleep(30)
        return 1.0

    @staticmethod
    async def never_calls(task: Task, client: Any) -> float:
        return 1.0

    @staticmethod
    async def fails_after_a_refusal(task: Task, client: Any) -> float:
        messages = [{"role": "user", "content": "go"}]
        for _ in range(5):
            try:
                await client.chat.completions.create(model="m", messages=messages)
            except Exception:
                break
        raise ValueError("the harness's own bug, after the budget was spent")

    @staticmethod
    async def long_prompt(task: Task, client: Any) -> float:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * 600}])
        return 1.0

    @staticmethod
    async def leaves_a_call_behind(task: Task, client: Any) -> float:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "one"}])
        _LEFT.append(
            asyncio.ensure_future(
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": "two"}])
            )
        )
        return 1.0

    @staticmethod
    async def talks_forever(task: Task, client: Any) -> float:
        messages = [{"role": "user", "content": "go"}]
        while True:  # the gateway refuses the call past rollout.max_turns (a 400): truncated
            reply = await client.chat.completions.create(model="m", messages=messages)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content}]
            messages += [{"role": "user", "content": "more"}]


def _episode(fmt: ChatFormat, fn: Any, timeout: float = 10.0) -> Trajectory:
    engine = ScriptedEngine(["4</s>"] * 8, encode=lambda s: fmt.template_ids(s))
    runner = HarnessRunner(Harness(fn, f"tests:{fn.__name__}", timeout))
    task = Task(id="t", prompt="1+1", env="harness")
    setup = _setup(fmt, engine, runner, budgets=Budgets(3, 8, 512))
    return asyncio.run(rollout_groups([task], 1, setup, seed=0))[0].trajectories[0]


@pytest.mark.parametrize(
    ("name", "end", "why"),
    [
        ("raises", EndReason.INFRA_FAILED, "KeyError"),
        ("no_number", EndReason.INFRA_FAILED, "not a finite reward"),
        ("hangs", EndReason.ENV_TIMEOUT, "ran past timeout_s"),
        ("never_calls", EndReason.INFRA_FAILED, "never called the model"),
        ("talks_forever", EndReason.TRUNCATED, "turn budget"),
        ("fails_after_a_refusal", EndReason.INFRA_FAILED, "own bug"),
        ("long_prompt", EndReason.TRUNCATED, "max_total_tokens"),
    ],
)
def test_a_harness_episode_ends_as_a_loop_episode_would(
    fmt: ChatFormat, name: str, end: EndReason, why: str
) -> None:
    traj = _episode(fmt, getattr(_Harnesses, name), timeout=0.5 if name == "hangs" else 10.0)
    assert traj.end is end
    assert why in str(traj.info.get("error", "")) + str(traj.info.get("refused", ""))
    if name == "talks_forever":  # the three calls the budget allows, kept and trainable
        assert len(traj.steps) == 3 and traj.trainable and extends_throughout(traj)
        assert traj.info["cut_by_cap"]  # the turn cap cut it, as the loop records
    if name == "long_prompt":  # a token budget cuts without the turn cap
        assert not traj.info["cut_by_cap"]
    if not traj.trainable:
        assert traj.outcome_reward == 0.0


_LEFT: list[Any] = []


def test_a_call_that_outlives_its_episode_is_refused_not_recorded(fmt: ChatFormat) -> None:
    engine = ScriptedEngine(["4</s>"] * 8, encode=lambda s: fmt.template_ids(s))
    runner = HarnessRunner(Harness(_Harnesses.leaves_a_call_behind, "tests:leaves", 10.0))
    setup = _setup(fmt, engine, runner, budgets=Budgets(3, 8, 512))

    async def episode_then_the_stray_call() -> tuple[Trajectory, Any]:
        groups = await rollout_groups([Task(id="t", prompt="1+1", env="harness")], 1, setup, seed=0)
        stray = await asyncio.gather(*_LEFT, return_exceptions=True)
        return groups[0].trajectories[0], stray[0]

    traj, stray = asyncio.run(episode_then_the_stray_call())
    assert traj.end is EndReason.ANSWERED and traj.info["gateway_calls"] in (1, 2)  # (2: it got in first)
    if traj.info["gateway_calls"] == 1:
        assert "session_closed" in str(stray) or "is over" in str(stray)
    gateway, _ = next(iter(runner._gateways.values()))
    assert gateway.sessions == {}  # nothing left behind


def test_a_branching_harness_trains_one_row_per_step(fmt: ChatFormat) -> None:
    traj = _episode(fmt, _Harnesses.branches)
    assert traj.end is EndReason.ANSWERED and traj.outcome_reward == 1.0
    assert traj.info["gateway_branches"] == 1 and not extends_throughout(traj)
    rows = training_view(traj, 0)
    assert len(rows) == 2  # each call on the prompt it was shown
    for row, step in zip(rows, traj.steps, strict=True):
        assert row.input_ids == step.prompt_ids + step.action_ids
        assert sum(row.loss_mask) == len(step.action_ids)


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ({"tasks": "calculator"}, "env.params.run"),
        ({"run": "steprl.envs.harness_play:calculator"}, "env.params.tasks"),
        ({"run": "steprl.envs.harness_play:nothing", "tasks": "calculator"}, "has no attribute"),
        ({"run": "steprl.envs.harness_play:play", "tasks": "calculator"}, "must take (task, client)"),
        ({"run": "steprl.envs.registry:make_env", "tasks": "calculator"}, "not an async function"),
        (
            {"run": "steprl.envs.harness_play:calculator", "tasks": "calculator", "timeout": 3},
            "env.params.timeout",
        ),
        ({"run": "steprl.envs.harness_play:calculator", "tasks": "no_such_env"}, "no_such_env"),
    ],
)
def test_bad_harness_params_are_one_line(params: dict[str, Any], says: str) -> None:
    with pytest.raises((UserError, EnvLoadError, KeyError)) as err:
        get_spec("harness", params)
    assert says in str(err.value) and "\n" not in str(err.value)


def _train_small(tmp_path: Path, extra: Sequence[str]) -> Any:
    from steprl.config import load_config
    from steprl.training.loop.trainer import train
    from tiny_runs import QUIET, SMALL

    cfg = load_config(
        "configs/harness_calculator_tiny.yaml",
        [
            *SMALL,
            *QUIET,
            f"run.output_dir={tmp_path / 'runs'}",
            f"model.cache_dir={tmp_path / 'cache'}",
            *extra,
        ],
    )
    return train(cfg, log=lambda s: None)


def test_a_harness_config_trains_from_yaml_asynchronously(tmp_path: Path) -> None:
    result = _train_small(
        tmp_path, ["rollout.max_staleness=1", "trainer.eval_every=2", "trainer.eval_tasks=4"]
    )
    assert len(result.history) == 2
    for m in result.history:
        assert m["gateway/calls"] >= 16 and m["gateway/provenance_errors"] == 0.0
        assert m["train/rows"] > 0 and m.get("end/infra_failed", 0.0) == 0.0
    assert "eval/success" in result.final

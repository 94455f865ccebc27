"""An env's tool schemas reach the chat template on every backend (issue 23, item 16).

The first prompt of an episode is the template's render of [system, task] with the env's tools
(Qwen3 renders them in a `<tools>` block). The calculator has one tool: its first prompt must be
the same ids whether the env is used directly, through the env pool (train and eval), through
the demonstrations' recorder (SFT) or behind the HTTP env server. The Ray env backend is checked
against the same ids in test_ray_backend.py (it shares that module's Ray instance).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

import pytest

from steprl.engines.base import SamplingParams
from steprl.engines.scripted import ScriptedEngine
from steprl.envs.base import Env, env_tools
from steprl.envs.registry import get_spec, make_env, make_tasks
from steprl.hosting.backend import InProcessBackend
from steprl.hosting.http_backend import HttpEnvBackend
from steprl.hosting.local_server import LocalEnvServer
from steprl.hosting.pool import EnvPool
from steprl.models import qwen3_testbed
from steprl.rollout.chat_format import ChatFormat
from steprl.rollout.context import AppendOnly
from steprl.rollout.demos import play_demos
from steprl.rollout.loop import Budgets, RolloutSetup, rollout_groups
from steprl.types import Task

BUDGETS = Budgets(max_turns=1, max_total_tokens=4096)  # room for the rendered tool schema


@pytest.fixture(scope="module")
def qwen() -> Any:
    return qwen3_testbed.load_tokenizer()


def calculator_task() -> Task:
    return next(islice(make_tasks("calculator", "train", 0), 1))


def first_prompt_ids(make: Callable[[Task], Env], tokenizer: Any) -> tuple[int, ...]:
    """The ids the model saw first in one calculator episode, through the agent loop."""
    encode = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    setup = RolloutSetup(
        make, ScriptedEngine(["<answer>0</answer>"], encode), ChatFormat(tokenizer), AppendOnly(),
        SamplingParams(), BUDGETS,
    )  # fmt: skip
    (group,) = asyncio.run(rollout_groups([calculator_task()], 1, setup, seed=0))
    (trajectory,) = group.trajectories
    assert trajectory.steps, trajectory.info
    return trajectory.steps[0].prompt_ids


def direct_prompt_ids(tokenizer: Any) -> tuple[int, ...]:
    """The reference: the env straight from its factory, which has the calculator's one tool."""
    assert len(env_tools(make_env("calculator"))) == 1
    ids = first_prompt_ids(lambda task: make_env("calculator"), tokenizer)
    text = tokenizer.decode(ids)
    assert "<tools>" in text and '"name": "calc"' in text, text
    return ids


@pytest.fixture(scope="module")
def http_backend() -> Iterator[HttpEnvBackend]:
    server = LocalEnvServer().start()
    backend = HttpEnvBackend(server.url, server.token, "calculator", {}, call_timeout_s=20.0, server=server)
    yield backend
    backend.close()


def test_the_first_prompt_carries_the_tools_directly_through_the_pool_the_demos_and_http(
    qwen, http_backend
) -> None:
    direct = direct_prompt_ids(qwen)
    pool = EnvPool(InProcessBackend("calculator", {}), max_concurrent=2)
    assert first_prompt_ids(pool.make_env, qwen) == direct  # train and eval (rollout_groups)
    assert first_prompt_ids(EnvPool(http_backend, 2).make_env, qwen) == direct  # runtime.backend: http

    # SFT: the demonstrations play the env through a recorder that wraps the pool's env
    spec = get_spec("calculator")
    (demo,) = asyncio.run(
        play_demos(
            [calculator_task()], strategies=spec.strategies, weights={"expert": 1.0},
            make_env=pool.make_env, fmt=ChatFormat(qwen), seed=0, rule=AppendOnly(), budgets=BUDGETS,
        )
    )  # fmt: skip
    assert demo.trajectory.steps[0].prompt_ids == direct

"""The in-process backend fails fast on an env that lacks a member the core reads, and puts a
user's sync env in processes of its own."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest

from steprl.config import RuntimeSection
from steprl.envs.base import Env, IncompleteEnv, Observation, Transition
from steprl.envs.registry import ENVS, get_spec, make_tasks, register
from steprl.hosting.backend import make_backend


class _NoPrompt:
    """Duck-typed (does not subclass Env) and forgot system_prompt."""

    stop_strings = ("</say>",)
    closed = 0

    def reset(self, task, seed):
        return Observation("hi")

    def step(self, action):
        return Transition("", 1.0, True)

    async def close(self):
        type(self).closed += 1


@pytest.fixture
def no_prompt_env():
    register(dataclasses.replace(get_spec("echo"), name="no_prompt", factory=_NoPrompt))
    yield "no_prompt"
    del ENVS["no_prompt"]


def test_missing_member_is_one_clear_error_before_any_episode(no_prompt_env):
    with pytest.raises(IncompleteEnv) as err:
        make_backend(no_prompt_env, {}, RuntimeSection())
    assert str(err.value) == (
        "env 'no_prompt': its factory returned _NoPrompt lacks system_prompt; subclass "
        "steprl.envs.base.Env (it gives system_prompt and stop_strings their defaults) or define them"
    )
    assert _NoPrompt.closed == 1  # the probe env was closed (its async close awaited)


def test_a_complete_env_passes_the_probe():
    backend = make_backend("echo", {}, RuntimeSection())
    assert backend.name == "inprocess"


class _Counter(Env):
    """A user's sync env: counts its steps."""

    def reset(self, task, seed):
        self.steps = 0
        return Observation(f"pid {os.getpid()}")

    def step(self, action):
        self.steps += 1
        return Transition(str(self.steps), 0.0, False)


async def _two_steps(backend) -> tuple[str, str]:
    env = backend.make_env(next(make_tasks("echo", "train", 0)))
    try:
        first = await env.reset(next(make_tasks("echo", "train", 0)), 0)
        await env.step("a")
        return first.text, (await env.step("b")).observation
    finally:
        await env.close()


@pytest.mark.parametrize(
    ("name", "factory", "own_process"),
    [
        ("counter", _Counter, True),  # a user's sync env: a process per instance (issue 44, item 6)
        ("counter_lambda", lambda: _Counter(), False),  # the zygote cannot find it: threads, with a warning
        ("echo", None, False),  # steprl's own: a thread here
    ],
)
def test_where_the_probe_puts_an_env(name, factory, own_process, caplog):
    if factory is not None:
        register(dataclasses.replace(get_spec("echo"), name=name, factory=factory))
    backend = make_backend(name, {}, RuntimeSection())
    try:
        assert (backend.processes is not None) == own_process
        if factory is not None:
            text, steps = asyncio.run(_two_steps(backend))
            assert steps == "2" and (text != f"pid {os.getpid()}") == own_process
        assert ("runs on threads in this process" in caplog.text) == (name == "counter_lambda")
    finally:
        backend.close()
        if factory is not None:
            del ENVS[name]

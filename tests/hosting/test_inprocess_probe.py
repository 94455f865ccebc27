"""The in-process backend fails fast on an env that lacks a member the core reads."""

from __future__ import annotations

import dataclasses

import pytest

from steprl.config import RuntimeSection
from steprl.envs.base import IncompleteEnv, Observation, Transition
from steprl.envs.registry import ENVS, get_spec, register
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

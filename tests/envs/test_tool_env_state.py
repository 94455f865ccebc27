"""A `ToolEnv` tool reads per-episode state (a secret number, a handle) without subclassing."""

from __future__ import annotations

import random

from steprl.envs.tool_env import FunctionTool, ToolEnv
from steprl.types import Task


class Secret:
    """The episode's state: a number drawn from the seed, and a count of closes (a handle's)."""

    closed = 0

    def __init__(self, task: Task, seed: int) -> None:
        self.number = random.Random(seed).randint(1, int(task.params["high"]))

    def close(self) -> None:
        Secret.closed += 1


def probe(guess: int, state: Secret) -> str:
    return "higher" if guess < state.number else "lower" if guess > state.number else "equal"


def verify(answer: str, task: Task, state: Secret) -> float:
    return float(answer.strip() == str(state.number))


PROBE = FunctionTool(
    name="probe",
    description="Compare a guess with the secret.",
    parameters={"type": "object", "properties": {"guess": {"type": "integer"}}, "required": ["guess"]},
    fn=probe,
)


def test_tools_and_verifier_read_the_episode_state() -> None:
    env = ToolEnv([PROBE], verify, episode=Secret)
    task = Task(id="t", prompt="guess 1..100", params={"high": 100}, env="guess")
    secret = random.Random(7).randint(1, 100)
    env.reset(task, seed=7)
    below = env.step('<tool_call>{"name": "probe", "arguments": {"guess": 0}}</tool_call>')
    assert below.observation == "<result>higher</result>"
    # the state is not part of the schema: a model that sends one gets an argument error
    forged = env.step('<tool_call>{"name": "probe", "arguments": {"guess": 0, "state": 1}}</tool_call>')
    assert forged.info["tool_call_valid"] is False
    done = env.step(f"<answer>{secret}</answer>")
    assert done.terminated and done.reward > 0 and done.info["reward_components"]["outcome"] == 1.0
    # a new episode builds a new state, closing the last one; close() closes the current one
    env.reset(task, seed=8)
    assert Secret.closed == 1
    env.close()
    env.close()
    assert Secret.closed == 2


def test_tools_without_state_are_called_as_before() -> None:
    echo = FunctionTool(
        "echo",
        "Echo.",
        {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]},
        lambda s: s,
    )
    env = ToolEnv([echo], lambda answer, task: 1.0)
    env.reset(Task(id="t", prompt="p", params={}, env="x"), seed=0)
    assert env.step("<echo>hi</echo>").observation == "<result>hi</result>"

"""The Gymnasium and MCP adapters: conformance (`check_spec`), error channels, seeding, cleanup."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import random
import re
import signal
import sys
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import pytest
from gymnasium import spaces
from gymnasium.envs.toy_text.frozen_lake import generate_random_map
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mcp import StdioServerParameters

from steprl.engines.base import SamplingParams
from steprl.engines.scripted import ScriptedEngine
from steprl.envs.adapters import (
    GymnasiumEnv,
    MCPToolEnv,
    MCPTransportError,
    make_gym_spec,
    shortest_path_expert,
    solved_on_termination,
)
from steprl.envs.adapters.gymnasium_env import split_of
from steprl.envs.base import Env
from steprl.envs.check import acheck_spec, check_spec
from steprl.envs.registry import EnvSpec
from steprl.rollout.chat import PlainFormat
from steprl.rollout.context import AppendOnly
from steprl.rollout.loop import Budgets, run_episode
from steprl.types import EndReason, Task

# --- Gymnasium: FrozenLake with a text observation (the grid, agent as 'A') ----------------------------

LAKE_ACTIONS = ["left", "down", "right", "up"]
_STEPS = {0: (0, -1), 1: (1, 0), 2: (0, 1), 3: (-1, 0)}


class FrozenLakeText(gym.ObservationWrapper[str, Any, Any]):
    """FrozenLake whose observation is the map with the agent drawn as 'A' (rows joined by newlines)."""

    def __init__(self, env: gym.Env[Any, Any]) -> None:
        super().__init__(env)
        self.rows = ["".join(c.decode() for c in row) for row in env.unwrapped.desc]  # type: ignore[attr-defined]
        size = len(self.rows) * (len(self.rows[0]) + 1)
        self.observation_space = spaces.Text(max_length=size, charset="SFHGA\n")

    def observation(self, observation: Any) -> str:
        row, col = divmod(int(observation), len(self.rows[0]))
        grid = [list(r) for r in self.rows]
        grid[row][col] = "A"
        return "\n".join("".join(r) for r in grid)


def frozen_lake_text(**kwargs: Any) -> gym.Env[str, Any]:
    return FrozenLakeText(gym.make("FrozenLake-v1", **kwargs))


def lake_expert(grid: str) -> int:
    """BFS over the map from the agent to the goal, avoiding holes; the first move of a shortest path."""
    rows = grid.split("\n")
    start = next((r, c) for r, row in enumerate(rows) for c, ch in enumerate(row) if ch == "A")
    queue: deque[tuple[tuple[int, int], int | None]] = deque([(start, None)])
    seen = {start}
    while queue:
        (r, c), first = queue.popleft()
        for move, (dr, dc) in _STEPS.items():
            nr, nc = r + dr, c + dc
            if not (0 <= nr < len(rows) and 0 <= nc < len(rows[0])) or (nr, nc) in seen:
                continue
            if rows[nr][nc] == "G":
                return move if first is None else first
            if rows[nr][nc] != "H":
                seen.add((nr, nc))
                queue.append(((nr, nc), move if first is None else first))
    raise AssertionError(f"no path to the goal in\n{grid}")


def _random_map(seed: int) -> dict[str, Any]:
    return {"desc": generate_random_map(size=4, seed=seed)}


LAKE_OPTIONS: dict[str, Any] = {
    "env_kwargs": {"is_slippery": False},
    "action_names": LAKE_ACTIONS,
    "description": "Walk the agent A over the frozen lake to the goal G; holes H end the episode.",
}
LAKE = make_gym_spec(
    "frozenlake",
    frozen_lake_text,
    expert=lake_expert,
    task_env_kwargs=_random_map,
    max_turns=20,
    **LAKE_OPTIONS,
)

# --- Gymnasium: Taxi with an integer observation and a renderer ----------------------------------------

TAXI_ACTIONS = ["south", "north", "east", "west", "pickup", "dropoff"]
TAXI_STOPS = "RGYB"


def render_taxi(obs: Any) -> str:
    """Taxi's state number as a short sentence (the map is in the system prompt)."""
    state = int(obs)
    dest, state = state % 4, state // 4
    passenger, state = state % 5, state // 5
    row, col = divmod(state, 5)
    where = "in the taxi" if passenger == 4 else f"at {TAXI_STOPS[passenger]}"
    return f"taxi at row {row}, column {col}; passenger {where}; destination {TAXI_STOPS[dest]}"


TAXI = make_gym_spec(
    "taxi",
    "Taxi-v4",
    render_obs=render_taxi,
    action_names=TAXI_ACTIONS,
    outcome=solved_on_termination,
    expert=shortest_path_expert(gym.make("Taxi-v4").unwrapped.P),  # type: ignore[attr-defined]
    max_turns=30,
    description="Drive the taxi on a 5x5 grid with walls; pick up the passenger, drop them off.",
)


def _lake_env(**params: Any) -> GymnasiumEnv:
    env = LAKE.factory(**params)
    assert isinstance(env, GymnasiumEnv)
    return env


def _lake_task(seed: int = 0) -> Task:
    return next(LAKE.tasks("train", seed))


def _trace(env: GymnasiumEnv, task: Task, seed: int, actions: Sequence[str]) -> list[Any]:
    out: list[Any] = [env.reset(task, seed).text]
    for action in actions:
        t = env.step(action)
        out.append((t.observation, t.reward, t.terminated, t.truncated, dict(t.info["reward_components"])))
        if t.terminated or t.truncated:
            break
    return out


@pytest.mark.parametrize("spec", [LAKE, TAXI], ids=["frozenlake", "taxi"])
def test_gym_specs_pass_check_spec(spec: EnvSpec):
    report = check_spec(spec, n_tasks=10, seed=0)
    assert report.expert_success_rate == 1.0
    assert report.random_success_rate < 1.0
    assert report.mean_expert_turns >= 1.0


def test_lake_expert_solves_and_reports_anchor_and_components():
    task = _lake_task()
    env = _lake_env()
    assert isinstance(env, Env)
    first = env.reset(task, task.seed)
    assert first.text == task.prompt and "A" in first.text and "G" in first.text
    assert "left, down, right, up" in env.system_prompt
    history: list[tuple[str, str]] = []
    state, total = first.text, 0.0
    for _ in range(LAKE.max_turns):
        action = LAKE.strategies["expert"](task, history, random.Random(0))
        assert re.fullmatch(r"<answer>(left|down|right|up)</answer>", action)
        t = env.step(action)
        assert t.info["anchor"] == state  # the state the action was taken in
        assert t.info["action_kind"] == "tool_call" and t.info["tool_call_valid"] is True
        assert t.reward == sum(t.info["reward_components"].values())
        history.append((action, t.observation))
        state, total = t.observation, total + t.reward
        if t.terminated:
            break
    assert t.terminated and not t.truncated and t.observation == ""
    assert total == 1.0 and t.info["reward_components"]["outcome"] == 1.0
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("<answer>left</answer>")
    env.close()
    env.close()


def test_named_and_integer_actions_and_invalid_ones():
    env = _lake_env(max_invalid_actions=2)
    task = _lake_task()
    env.reset(task, task.seed)
    assert env.step("<answer>0</answer>").info["env_action"] == 0  # left into the wall: no move
    assert env.step("<think>go</think> <answer> LEFT </answer>").info["env_action"] == 0
    bad = env.step("<answer>4</answer>")
    assert bad.info["action_kind"] == "invalid" and bad.observation.startswith("<error>unknown action")
    assert bad.reward == -0.1 and bad.info["reward_components"]["format"] == -0.1 and not bad.terminated
    assert env.step("move left").info["action_kind"] == "invalid"
    last = env.step("<answer>jump</answer>")  # the third invalid action: more than 2 tolerated
    assert last.terminated and last.info["policy_error"] and last.observation == ""


def test_truncation_maps_to_transition():
    env = GymnasiumEnv(
        frozen_lake_text, env_kwargs={"is_slippery": False, "max_episode_steps": 3}, action_names=LAKE_ACTIONS
    )
    task = _lake_task()
    env.reset(task, task.seed)
    steps = [env.step("<answer>up</answer>") for _ in range(3)]  # against the top wall
    assert [s.truncated for s in steps] == [False, False, True]
    assert not steps[-1].terminated and steps[-1].observation == ""


def test_constructor_errors_say_how_to_fix():
    with pytest.raises(ValueError, match="render_obs"):
        GymnasiumEnv("FrozenLake-v1")  # integer observations, no renderer
    with pytest.raises(ValueError, match="one name per action"):
        GymnasiumEnv(frozen_lake_text, action_names=["left", "right"])
    with pytest.raises(ValueError, match="action_parser"):
        GymnasiumEnv("MountainCarContinuous-v0", render_obs=str)  # a Box action space


_HYPOTHESIS_ENV = _lake_env(max_invalid_actions=10**6)
_HYPOTHESIS_TASK = _lake_task(3)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.text(max_size=80), st.text(max_size=20).map(lambda s: f"<answer>{s}</answer>")))
def test_invalid_actions_never_raise(text: str):
    env = _HYPOTHESIS_ENV
    env.reset(_HYPOTHESIS_TASK, 0)
    t = env.step(text)
    assert t.info["action_kind"] in ("invalid", "tool_call")
    assert t.reward == sum(t.info["reward_components"].values())
    if t.info["action_kind"] == "invalid":
        assert t.observation.startswith("<error>") and t.reward == -0.1


def test_determinism_per_seed():
    task = _lake_task(1)
    rng = random.Random(0)
    actions = [f"<answer>{rng.choice(LAKE_ACTIONS)}</answer>" for _ in range(12)]
    assert _trace(_lake_env(), task, task.seed, actions) == _trace(_lake_env(), task, task.seed, actions)
    # Slippery ice: the task fixes the start; the episode seed fixes the dynamics, deterministically.
    slippery = {**LAKE_OPTIONS, "env_kwargs": {"is_slippery": True}}
    traces = {s: _trace(GymnasiumEnv(frozen_lake_text, **slippery), task, s, actions) for s in (5, 6, 7, 8)}
    assert all(trace[0] == task.prompt for trace in traces.values())
    assert traces[5] == _trace(GymnasiumEnv(frozen_lake_text, **slippery), task, 5, actions)
    assert len({json.dumps(t) for t in traces.values()}) > 1
    assert [t.prompt for t in LAKE.tasks("eval", 4, n=5)] == [t.prompt for t in LAKE.tasks("eval", 4, n=5)]


def test_taxi_renders_and_scores_success_only():
    task = next(TAXI.tasks("train", 0))
    env = TAXI.factory()
    assert isinstance(env, GymnasiumEnv)
    assert env.reset(task, task.seed).text == task.prompt and task.prompt.startswith("taxi at row")
    t = env.step("<answer>dropoff</answer>")  # illegal drop-off: env reward -10, outcome 0
    assert t.info["env_reward"] == -10.0 and t.reward == 0.0 and not t.terminated


def test_split_of_is_stable_and_fractional():
    assert split_of("abc", 0.2) == split_of("abc", 0.2)
    shares = [split_of(str(i), 0.2) == "eval" for i in range(2000)]
    assert 0.15 < sum(shares) / len(shares) < 0.25


# --- MCP -------------------------------------------------------------------------------------------------

SERVER = Path(__file__).with_name("mcp_test_server.py")
PARAMS = StdioServerParameters(command=sys.executable, args=[str(SERVER)])
sys.path.insert(0, str(SERVER.parent))
from mcp_test_server import TABLE  # noqa: E402


def _call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def _verify(answer: str, task: Task) -> float:
    return 1.0 if answer.strip() == task.answer else 0.0


def _mcp_env(**options: Any) -> MCPToolEnv:
    return MCPToolEnv(PARAMS, _verify, **options)


def _children() -> set[int]:
    """Live or unreaped child processes of this process (Linux /proc)."""
    me, found = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                found.add(int(entry))
    return found


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


TASK = Task(id="mcp-0", prompt="What is 2 plus 3?", env="mcp-test", answer="5")
needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")


@needs_proc
def test_mcp_prompt_round_trip_errors_and_cleanup():
    before = _children()

    async def episode() -> list[Any]:
        env = _mcp_env(instructions="Answer with a number.")
        first = await env.reset(TASK, 0)
        assert first.text == TASK.prompt
        assert set(env.tools) == {"add", "lookup", "fail", "pid", "sleep", "crash"}
        prompt = env.system_prompt
        assert prompt.startswith("Answer with a number.")
        assert '- add: Add two integers.\n  arguments: {"properties": {"a": {"type": "integer"}' in prompt
        assert "<tool_call>" in prompt and "<answer>" in prompt and "title" not in prompt
        assert env.server_instructions == "Arithmetic and a fruit colour table."
        assert list(env.stop_strings) == ["</tool_call>", "</answer>"]
        out = [
            await env.step(_call("add", a=2, b=3)),
            await env.step(_call("lookup", key="apple")),
            await env.step(_call("lookup", key="durian")),  # the tool reports an error
            await env.step(_call("fail")),  # the tool raises: an isError result
            await env.step(_call("add", a="2", b=3)),  # breaks the schema: never sent
            await env.step(_call("lookup", key="\ud800")),  # not UTF-8: never sent
            await env.step(_call("nope")),
            await env.step('<tool_call>{"name": "add", "arguments": [1]}</tool_call>'),
            await env.step("<tool_call>{not json</tool_call>"),
        ]
        pid = int(
            (await env.step(_call("pid"))).observation.removeprefix("<result>").removesuffix("</result>")
        )
        # The tools are steprl Tools: async in the loop, sync from another thread.
        assert await env.tools["add"].acall(a=4, b=5) == "9"
        assert await asyncio.to_thread(env.tools["lookup"], key="lime") == "green"
        with pytest.raises(RuntimeError, match="inside its event loop"):
            env.tools["add"](a=1, b=1)
        out.append(await env.step("<answer>5</answer>"))
        await env.close()
        await env.close()
        return [*out, pid]

    *transitions, pid = asyncio.run(episode())
    ok, colour, missing, failed, typed, surrogate, unknown, not_object, bad_json, answer = transitions
    assert ok.observation == "<result>5</result>" and ok.info["tool_call_valid"] is True
    assert colour.observation == f"<result>{TABLE['apple']}</result>"
    assert missing.observation.startswith("<error>") and "no entry for 'durian'" in missing.observation
    assert failed.observation.startswith("<error>") and failed.info["tool_call_valid"] is False
    assert typed.observation == "<error>argument 'a' must be integer</error>"
    assert surrogate.observation == "<error>arguments must be valid UTF-8 text</error>"
    for t in (missing, failed, typed, surrogate):
        assert t.info["action_kind"] == "tool_call" and not t.terminated and t.reward == 0.0
    for t in (unknown, not_object, bad_json):
        assert t.info["action_kind"] == "invalid" and t.observation.startswith("<error>") and t.reward == -0.1
    assert answer.terminated and answer.reward == 1.0 and answer.info["action_kind"] == "answer"
    assert _gone(pid)
    assert _children() <= before


@needs_proc
def test_mcp_server_killed_mid_episode_raises_and_close_is_clean():
    before = _children()

    async def episode() -> tuple[int, int]:
        env = _mcp_env()
        await env.close()  # before any reset: a no-op
        await env.reset(TASK, 0)
        first = int((await env.step(_call("pid"))).observation[len("<result>") : -len("</result>")])
        await env.reset(TASK, 1)  # a new episode gets a new server; the old one is shut down
        assert _gone(first)
        pid = int((await env.step(_call("pid"))).observation[len("<result>") : -len("</result>")])
        assert pid != first
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(MCPTransportError, match="Connection closed"):
            await env.step(_call("add", a=1, b=2))
        with pytest.raises(RuntimeError, match="transport failure"):
            await env.step("<answer>3</answer>")
        await env.close()
        await env.close()
        return first, pid

    first, pid = asyncio.run(episode())
    assert _gone(first) and _gone(pid)
    assert _children() <= before


@needs_proc
def test_mcp_crash_in_run_episode_is_infra_failed(tokenizer):
    before = _children()
    engine = ScriptedEngine(
        [_call("add", a=2, b=3), _call("crash"), "<answer>5</answer>"],
        lambda s: tokenizer.encode(s, add_special_tokens=False),
    )
    traj = asyncio.run(
        run_episode(
            _mcp_env(),
            TASK,
            engine=engine,
            fmt=PlainFormat(tokenizer),
            rule=AppendOnly(),
            sampling=SamplingParams(),
            budgets=Budgets(max_turns=4, max_tokens_per_turn=120, max_total_tokens=2000),
            group_id="g",
            seed=0,
        )
    )
    assert traj.end is EndReason.INFRA_FAILED and not traj.trainable
    assert "MCPTransportError" in str(traj.info["error"]) and "close_error" not in traj.info
    assert len(traj.steps) == 1  # the successful add; the crashed call never became a step
    assert _children() <= before


@needs_proc
def test_mcp_hung_call_times_out_as_transport_error():
    before = _children()

    async def episode() -> None:
        env = _mcp_env(call_timeout_s=0.5)
        await env.reset(TASK, 0)
        with pytest.raises(MCPTransportError, match="call_timeout_s"):
            await env.step(_call("sleep", seconds=30))
        await env.close()

    asyncio.run(episode())
    assert _children() <= before


def test_mcp_startup_failure_raises_transport_error():
    broken = StdioServerParameters(command=sys.executable, args=["-c", "import sys; sys.exit(1)"])
    env = MCPToolEnv(broken, _verify)
    with pytest.raises(MCPTransportError, match="could not start MCP server"):
        asyncio.run(env.reset(TASK, 0))


# --- MCP: a whole spec through acheck_spec --------------------------------------------------------------


def _mcp_tasks(split: str, seed: int, **_: Any) -> Iterator[Task]:
    """Alternately an `add` and a `lookup` question (so two tasks cover both tools)."""
    rng, index = random.Random(seed), 0
    while True:
        if index % 2 == 0:
            a, b = rng.randint(1, 99), rng.randint(1, 99)
            prompt, call, answer = (
                f"What is {a} plus {b}?",
                {"name": "add", "arguments": {"a": a, "b": b}},
                str(a + b),
            )
        else:
            key = rng.choice(sorted(TABLE))
            prompt, call, answer = (
                f"What colour is the fruit {key!r}?",
                {"name": "lookup", "arguments": {"key": key}},
                TABLE[key],
            )
        if split_of(prompt, 0.2) == split:
            yield Task(
                f"mcp-{split}-{seed}-{index}", prompt, "mcp-test", answer=answer, params={"call": call}
            )
            index += 1


def _mcp_expert(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    if not history:
        return f"<tool_call>{json.dumps(task.params['call'])}</tool_call>"
    result = re.fullmatch(r"<result>(.*)</result>", history[-1][1], re.S)
    assert result is not None, history
    return f"<answer>{result.group(1)}</answer>"


def _mcp_random(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    options = [
        lambda: "".join(rng.choice('{}"<>/:abc tool_call') for _ in range(rng.randint(0, 30))),
        lambda: _call("add", a=rng.randint(-5, 5), b=rng.choice([1, "x", None])),
        lambda: _call("lookup", key=rng.choice(["apple", "kiwi", ""])),
        lambda: _call("fail"),
        lambda: f"<answer>{rng.randint(0, 200)}</answer>",
    ]
    return rng.choice(options)()


MCP_SPEC = EnvSpec(
    name="mcp-test",
    factory=functools.partial(MCPToolEnv, PARAMS, _verify),
    tasks=_mcp_tasks,
    strategies={"expert": _mcp_expert, "random": _mcp_random},
    max_turns=4,
)


@needs_proc
def test_mcp_spec_passes_acheck_spec():
    before = _children()
    report = asyncio.run(acheck_spec(MCP_SPEC, n_tasks=2, seed=0))
    assert report.expert_success_rate == 1.0 and report.mean_expert_tool_calls == 1.0
    assert report.random_success_rate < 1.0
    assert _children() <= before

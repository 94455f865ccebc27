"""The mcp env family from params alone (`mcp_yaml.mcp_spec`): checked params, scoring, the
scripted strategies, start-up errors, per-episode state, and `check_spec` on a real server."""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

import pytest

from steprl.envs.adapters.mcp_pool import close_pools
from steprl.envs.adapters.mcp_session import MCPStartError, MCPTransportError
from steprl.envs.adapters.mcp_yaml import (
    AnswerMatch,
    MCPConfigError,
    make_mcp_env,
    mcp_spec,
    parse_params,
    perturb,
)
from steprl.envs.check import check_spec
from steprl.envs.registry import get_spec
from steprl.envs.task_file import TaskFile, with_task_file
from steprl.errors import UserError
from steprl.types import Task

ROOT = Path(__file__).resolve().parents[2]
TIME = {"command": "mcp-server-time", "args": ["--local-timezone", "UTC"]}
SQLITE = ROOT / ".venv-mcp-sqlite" / "bin" / "mcp-server-sqlite"
BOOM = [sys.executable, "-c", "import sys; sys.stderr.write('boom: bad flag\\n'); sys.exit(3)"]


@pytest.fixture(autouse=True)
def _close_pools():
    yield
    close_pools()


def _call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


# --- params ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "pattern"),
    [
        (
            {**TIME, "comand": "x"},
            r"env\.params\.comand is not a parameter of the mcp env; allowed: command, args",
        ),
        ({"args": []}, r"env\.params\.command is required"),
        ({**TIME, "args": "--local-timezone UTC"}, r"env\.params\.args must be a list of strings"),
        ({**TIME, "max_servers": 0}, r"env\.params\.max_servers must be an integer >= 1, got 0"),
        ({**TIME, "call_timeout_s": -1}, r"env\.params\.call_timeout_s must be a positive number"),
        ({**TIME, "reuse": "yes"}, r"env\.params\.reuse must be true or false"),
        ({**TIME, "env": {"A": None}}, r"env\.params\.env must be a mapping of variable names to strings"),
        (
            {**TIME, "reward": {"match": "fuzzy"}},
            r"reward\.match must be one of exact, contains, number, regex",
        ),
        (
            {**TIME, "reward": {"mode": "exact"}},
            r"env\.params\.reward\.mode is unknown; allowed: match, field",
        ),
        ({**TIME, "reuse": True, "args": ["{episode_dir}/x"]}, r"reuse: true .* \{episode_dir\}"),
    ],
)
def test_bad_params_are_one_line_user_errors(params, pattern):
    with pytest.raises(MCPConfigError, match=pattern) as caught:
        mcp_spec(params)
    assert isinstance(caught.value, UserError) and "\n" not in str(caught.value)


def test_commands_resolve_and_a_missing_one_says_how_to_fix_it():
    with pytest.raises(MCPConfigError, match=r"'no-such-mcp-server' is not on PATH nor in .*pip install"):
        mcp_spec({"command": "no-such-mcp-server"})
    with pytest.raises(MCPConfigError, match=r"is not an executable file"):
        mcp_spec({"command": "/nonexistent/bin/server"})
    p = parse_params({**TIME, "args": ["--port", 8080], "env": {"N": 3}, "max_turns": 4})
    assert p.args == ("--port", "8080") and p.env == {"N": "3"} and p.max_turns == 4


def test_spec_shape_tasks_come_from_a_file_and_the_registry_builds_it(tmp_path):
    params = {**TIME, "max_turns": 3, "replayable": False, "not_replayable_because": "a clock"}
    spec = mcp_spec(params)
    assert spec.name == "mcp:mcp-server-time" and spec.max_turns == 3
    assert {"expert", "guess", "random"} <= set(spec.strategies)
    assert getattr(spec, "replayable", False) is False
    with pytest.raises(MCPConfigError, match=r"takes its tasks from a file: add env\.task_file"):
        spec.tasks("train", 0)
    assert get_spec("mcp", TIME).name == "mcp:mcp-server-time"  # the registry's family table


def test_answer_matching():
    task = Task("t", "p", "e", answer="20:00", params={"answer": "20:00", "alt": ["Paris", "paris, France"]})
    exact, alt = AnswerMatch(), AnswerMatch(field="alt")
    assert exact(" 20:00 ", task) == 1.0 and exact("20:01", task) == 0.0
    assert alt("PARIS", task) == 1.0 and AnswerMatch(field="alt", case_sensitive=True)("PARIS", task) == 0.0
    assert AnswerMatch("contains")("It is 20:00 there.", task) == 1.0
    number = AnswerMatch("number", field="n", tolerance=0.01)
    assert number("about 3,141.5 km", Task("n", "p", "e", params={"n": 3141.505})) == 1.0
    assert number("none", Task("n", "p", "e", params={"n": 1})) == 0.0
    regex = AnswerMatch("regex", field="pattern")
    assert regex("20:00", Task("r", "p", "e", answer="20:00", params={"pattern": r"20:0\d"})) == 1.0
    with pytest.raises(MCPConfigError, match=r"task 'x' has no 'answer' field"):
        exact("a", Task("x", "p", "e"))


def test_strategies_play_the_solution_and_guess_wrong():
    spec = mcp_spec(TIME)
    solution = [{"name": "convert_time", "arguments": {"source_timezone": "UTC", "time": "10:00"}}]
    task = Task("t", "p", "e", answer="19:00", params={"answer": "19:00", "solution": solution})
    expert, guess, rnd = (spec.strategies[k] for k in ("expert", "guess", "random"))
    rng = random.Random(0)
    assert expert(task, [], rng) == f"<tool_call>{json.dumps(solution[0])}</tool_call>"
    assert expert(task, [("a", "o")], rng) == "<answer>19:00</answer>"
    for seed in range(50):
        wrong = guess(task, [], random.Random(seed))
        assert wrong.startswith("<answer>") and wrong != "<answer>19:00</answer>"
        assert isinstance(rnd(task, [], random.Random(seed)), str)
    assert all(
        perturb(text, random.Random(s)) != text
        for text in ("20:00", "42", "Paris", "", "a1")
        for s in range(20)
    )
    bad = Task("b", "p", "e", answer="1", params={"solution": {"name": "x"}})
    with pytest.raises(MCPConfigError, match=r"task 'b': solution must be a list of tool calls"):
        expert(bad, [], rng)


# --- real servers ----------------------------------------------------------------------------------------


def test_a_server_that_exits_at_start_reports_its_stderr():
    env = make_mcp_env(command=BOOM[0], args=BOOM[1:])
    with pytest.raises(MCPStartError, match="boom: bad flag") as caught:
        asyncio.run(env.reset(Task("t", "p", "e", answer="1"), 0))
    message = str(caught.value)
    assert isinstance(caught.value, UserError) and isinstance(caught.value, MCPTransportError)
    assert "could not start MCP server" in message and "ExceptionGroup" not in message and "\n" not in message
    assert "sys.exit(3)" in message  # the command line


def _time_tasks(tmp_path: Path) -> Path:
    rows = []
    for i, (src, time, dst, answer) in enumerate(
        [
            ("Asia/Tokyo", "23:30", "Asia/Kolkata", "20:00"),
            ("Asia/Dubai", "06:15", "America/Phoenix", "19:15"),
            ("Africa/Nairobi", "12:00", "Asia/Singapore", "17:00"),
            ("Asia/Shanghai", "08:45", "Asia/Dubai", "04:45"),
        ]
    ):
        call = {
            "name": "convert_time",
            "arguments": {"source_timezone": src, "time": time, "target_timezone": dst},
        }
        rows.append(
            {
                "id": f"time-{i}",
                "prompt": f"It is {time} in {src}. What time is it in {dst}?",
                "answer": answer,
                "solution": [call],
                "split": "eval" if i == 3 else "train",
            }
        )
    path = tmp_path / "time.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_time_server_spec_passes_check_spec(tmp_path):
    params = {**TIME, "reuse": True, "max_servers": 2, "max_turns": 3, "instructions": "Answer HH:MM."}
    spec = with_task_file(mcp_spec(params), TaskFile(str(_time_tasks(tmp_path))))
    report = check_spec(spec, n_tasks=3, seed=0, env_params=params)
    assert report.expert_success_rate == 1.0 and report.mean_expert_tool_calls == 1.0
    assert report.strategy_success["guess"] == 0.0 and report.random_success_rate == 0.0


@pytest.mark.skipif(
    not SQLITE.exists(),
    reason=f"{SQLITE} is missing: `make venv` builds .venv-mcp-sqlite (mcp-server-sqlite)",
)
def test_episode_dir_gives_a_stateful_server_fresh_state_per_episode():
    params = {"command": str(SQLITE), "args": ["--db-path", "{episode_dir}/db.sqlite"], "max_turns": 4}
    task = Task("sql", "p", "mcp:mcp-server-sqlite", answer="x")

    async def tables(env: Any) -> str:
        return (await env.step(_call("list_tables"))).observation

    async def scenario() -> list[str]:
        first, second = make_mcp_env(**params), make_mcp_env(**params)
        await asyncio.gather(first.reset(task, 0), second.reset(task, 0))  # concurrent episodes
        dirs = [first.episode_dir, second.episode_dir]
        assert dirs[0] != dirs[1] and all(d and os.path.isdir(d) for d in dirs)
        created = await first.step(_call("create_table", query="CREATE TABLE notes (x TEXT)"))
        assert "created" in created.observation.lower()
        seen = [await tables(first), await tables(second)]
        await first.reset(task, 1)  # the next episode of the same env instance
        assert first.episode_dir not in dirs and not os.path.exists(str(dirs[0]))
        seen.append(await tables(first))
        await asyncio.gather(first.close(), second.close())
        assert not any(os.path.exists(str(d)) for d in dirs)
        return seen

    in_first, concurrent, next_episode = asyncio.run(scenario())
    assert "notes" in in_first and "notes" not in concurrent and "notes" not in next_episode

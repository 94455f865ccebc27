"""Bad input from the command line: one clear line, exit code 2, no traceback (issue 11).

Each case runs the real `steprl` entry point in a subprocess on a config that is wrong in one
way, and checks the exit code, that stderr/stdout hold no traceback, and that the message
names the input that is wrong.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from cli_runs import TINY_SCRATCH, assert_one_line, run_steprl

pytestmark = pytest.mark.e2e


def _run(tmp_path: Path, env: dict[str, object], *extra: str, command: str = "train") -> tuple[int, str]:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml.safe_dump({"env": env, "logging": {"tensorboard": False, "progress": False}}))
    return run_steprl([command, str(cfg), *extra], tmp_path)


def test_a_plugin_that_fails_to_import(tmp_path: Path) -> None:
    rc, out = _run(tmp_path, {"name": "calculator"}, "--plugin", "no_such_plugin_module")
    assert_one_line(rc, out, "plugin 'no_such_plugin_module' failed to import", "ModuleNotFoundError")


def test_a_plugin_that_raises_on_import(tmp_path: Path) -> None:
    (tmp_path / "broken_plugin.py").write_text("raise RuntimeError('the plugin is broken')\n")
    rc, out = _run(tmp_path, {"name": "calculator", "plugins": ["broken_plugin"]})
    assert_one_line(rc, out, "plugin 'broken_plugin'", "the plugin is broken")


def test_an_import_path_to_a_non_spec(tmp_path: Path) -> None:
    rc, out = _run(tmp_path, {"name": "steprl.envs.registry:ENTRY_POINT_GROUP"})
    assert_one_line(rc, out, "steprl.envs.registry:ENTRY_POINT_GROUP", "is a str, not an EnvSpec")


def test_an_import_path_to_a_missing_module(tmp_path: Path) -> None:
    rc, out = _run(tmp_path, {"name": "no_such_pkg.envs:SPEC"})
    assert_one_line(rc, out, "no_such_pkg.envs:SPEC", "ModuleNotFoundError")


def test_an_unknown_env_name(tmp_path: Path) -> None:
    rc, out = _run(tmp_path, {"name": "calculater"})
    assert_one_line(rc, out, "unknown env 'calculater'", "calculator")


def test_a_gymnasium_id_that_does_not_exist(tmp_path: Path) -> None:
    rc, out = _run(tmp_path, {"name": "gym", "params": {"id": "NoSuchEnv-v0"}})
    assert_one_line(rc, out, "NoSuchEnv")


def test_a_task_file_with_a_bad_row(tmp_path: Path) -> None:
    rows = tmp_path / "tasks.jsonl"
    rows.write_text('{"prompt": "1+1", "answer": "2"}\n{"prompt": 3, "answer": "4"}\n')
    rc, out = _run(tmp_path, {"name": "calculator", "task_file": {"path": str(rows)}})
    assert_one_line(rc, out, "tasks.jsonl", "2", "prompt")


def test_an_mcp_server_that_exits_at_start(tmp_path: Path) -> None:
    crash = "import sys; sys.stderr.write('boom: no such flag --frobnicate\\n'); sys.exit(3)"
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"prompt": "what time is it?", "answer": "12:00"}\n' * 1)
    rc, out = _run(
        tmp_path,
        {
            "name": "mcp",
            "params": {"command": sys.executable, "args": ["-c", crash]},
            "task_file": {"path": str(tasks), "eval_fraction": 0.5},
        },
    )
    assert_one_line(rc, out, "boom: no such flag --frobnicate")


@pytest.mark.parametrize("depth", [980, 100_000])  # past our bound; past json's (Python's recursion limit)
def test_a_task_file_row_nested_too_deep(tmp_path: Path, depth: int) -> None:
    rows = tmp_path / "tasks.jsonl"
    rows.write_text(
        '{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2", "x": ' + "[" * depth + "]" * depth + "}\n"
    )
    rc, out = _run(tmp_path, {"name": "calculator", "task_file": {"path": str(rows)}})
    assert_one_line(rc, out, "tasks.jsonl, line 2", "nested deeper than 64 levels")


def test_a_step_reward_kind_that_is_not_a_step_reward_class(tmp_path: Path) -> None:
    # os.system is callable: it passed as a kind, and the run crashed calling it with the model
    sets = [x for s in (*TINY_SCRATCH, "algorithm.step_reward.kind=os:system") for x in ("--set", s)]
    rc, out = _run(tmp_path, {"name": "calculator"}, *sets)
    assert_one_line(rc, out, "algorithm.step_reward.kind 'os:system'", "not a step-reward class")

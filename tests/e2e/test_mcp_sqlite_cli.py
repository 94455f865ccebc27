"""A stateful MCP server from PyPI (mcp-server-sqlite, in its own venv: it needs mcp < 2) is
isolated per episode from a YAML config and the plain CLI (issue 11).

Every task's expert creates a table and then lists the tables. `steprl check-env` replays each
expert episode in a second env instance: with `{episode_dir}` in the server's args each
episode gets a fresh database, so the replay matches and the check passes. With a fixed
`--db-path` (the control) the table of one episode leaks into the next: the replay's
`CREATE TABLE` fails, and the check says so.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml

import cli_zygote

ROOT = Path(__file__).resolve().parents[2]
SQLITE = ROOT / ".venv-mcp-sqlite" / "bin" / "mcp-server-sqlite"
STEPRL = str(Path(sys.executable).parent / "steprl")

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not SQLITE.exists(), reason=f"{SQLITE} is missing: `make venv` builds it"),
]


def _config(tmp_path: Path, db_path: str) -> Path:
    rows = []
    for i, table in enumerate(["notes", "books", "users", "tasks", "songs", "cards", "maps", "tools"]):
        rows.append(
            {
                "id": f"sql-{i}",
                "prompt": f"Create a table {table} with one text column x, then list the tables.",
                "answer": table,
                "split": "eval" if i >= 6 else "train",
                "solution": [
                    {"name": "create_table", "arguments": {"query": f"CREATE TABLE {table} (x TEXT)"}},
                    {"name": "list_tables", "arguments": {}},
                ],
            }
        )
    tasks = tmp_path / "sql_tasks.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {
        "env": {
            "name": "mcp",
            "params": {
                "command": str(SQLITE),
                "args": ["--db-path", db_path],
                "include_tools": ["create_table", "list_tables"],
                "reward": {"match": "contains", "field": "answer"},
                "max_turns": 4,
            },
            "task_file": {"path": str(tasks)},
        }
    }
    path = tmp_path / "sqlite.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _check_env(config: Path) -> tuple[int, str]:
    done = cli_zygote.run(
        [STEPRL, "check-env", str(config), "--tasks", "3"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "300"},
        check=False,
    )
    return done.returncode, done.stdout + done.stderr


def test_each_episode_gets_a_fresh_database(tmp_path: Path) -> None:
    rc, out = _check_env(_config(tmp_path, "{episode_dir}/db.sqlite"))
    assert rc == 0, out
    assert "ok" in out and "Traceback" not in out


def test_a_fixed_database_leaks_between_episodes_and_the_check_catches_it(tmp_path: Path) -> None:
    rc, out = _check_env(_config(tmp_path, str(tmp_path / "shared.sqlite")))
    assert rc == 1, out
    assert "replay" in out.lower() and "Traceback" not in out, out

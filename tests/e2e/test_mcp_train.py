"""A real MCP server from PyPI trains from YAML alone, with the plain CLI (issue 11).

`configs/mcp_time.yaml` (mcp-server-time, tasks from configs/tasks/time_tasks.jsonl, reuse)
runs for 3 steps with the default warm start (`model.init: sft`, demonstrations played by
the agent loop on the async MCP env), at small shapes. The server is started through a
wrapper that logs each start's pid, so the test counts the servers the run started (reuse:
at most `max_servers`, not one per episode) and checks that none outlives the run.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import yaml

import cli_zygote

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

pytestmark = [pytest.mark.e2e, pytest.mark.soak]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(shutil.which("mcp-server-time", path=str(BIN)) is None, reason="needs mcp-server-time")
def test_mcp_time_trains_from_yaml_with_reuse_and_no_orphans(tmp_path: Path) -> None:
    starts = tmp_path / "starts.log"
    wrapper = tmp_path / "time-server"
    wrapper.write_text(f'#!/bin/sh\necho $$ >> {starts}\nexec {BIN / "mcp-server-time"} "$@"\n')
    wrapper.chmod(0o755)
    cfg = yaml.safe_load((ROOT / "configs" / "mcp_time.yaml").read_text())
    cfg["env"]["params"]["command"] = str(wrapper)
    cfg["env"]["task_file"]["path"] = str(ROOT / "configs" / cfg["env"]["task_file"]["path"])
    max_servers = cfg["env"]["params"]["max_servers"]
    cfg["run"].update(output_dir=str(tmp_path / "runs"))
    cfg["model"].update(
        cache_dir=str(tmp_path / "cache"),
        # the smallest model and warm start that still play every phase through the server:
        # this test is about the env's plumbing (reuse, no orphans), not about learning
        tiny={"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64},
        sft={"skill_steps": 10, "steps": 5, "num_episodes": 48, "batch_size": 16},
    )
    cfg["rollout"].update(tasks_per_step=4, group_size=4)
    cfg["trainer"].update(total_steps=3, eval_every=0, eval_tasks=4)
    cfg["logging"] = {"tensorboard": False, "progress": False}
    path = tmp_path / "mcp_time.yaml"
    path.write_text(yaml.safe_dump(cfg))

    done = cli_zygote.run(
        [str(BIN / "steprl"), "train", str(path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "COLUMNS": "200"},
        check=False,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "RL-trained : success" in out
    # the default warm start ran, on demonstrations played through the MCP env
    phases = re.findall(r"phase (\w+): (\d+) demonstrations", out)
    assert [p for p, _ in phases] == ["skills", "mixture"] and all(int(n) >= 40 for _, n in phases), out
    pids = [int(line) for line in starts.read_text().split()]
    # ~150 episodes (demos, 3 steps of 16, 2 evaluations) on at most max_servers servers
    assert 1 <= len(pids) <= max_servers, pids
    assert not [pid for pid in pids if _alive(pid)], "an MCP server outlived the run"

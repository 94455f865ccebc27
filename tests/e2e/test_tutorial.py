"""docs/your-own-env.md runs as written: its files are written out, its commands run in order.

A block preceded by ``<!-- file: PATH -->`` is written to PATH (under a temp dir); a block
preceded by ``<!-- run -->`` is run line by line there, with this venv's `steprl` and `pip`
first on PATH. The user package is installed into the venv (editable) and uninstalled at the
end, so the entry point is real. The commands train for 3 steps in-process (entry point and
import path), behind an HTTP env server and on Ray env workers (plugin).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "your-own-env.md"
_BLOCK = re.compile(r"<!-- (file: (?P<path>\S+)|run) -->\n```\w*\n(?P<body>.*?)```", re.S)

pytestmark = [pytest.mark.soak, pytest.mark.e2e]


def blocks() -> list[tuple[str | None, str]]:
    """(path or None for a command block, body) in document order."""
    return [(m.group("path"), m.group("body")) for m in _BLOCK.finditer(DOC.read_text())]


def _env() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env["COLUMNS"] = "400"  # rich wraps at the terminal width: one log line stays one line
    return env


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    subprocess.run(
        [sys.executable, "-m", "pip", "uninstall", "--quiet", "-y", "my-envs"],
        capture_output=True,
        check=False,
    )


def test_the_tutorial_has_its_files_and_commands() -> None:
    found = blocks()
    paths = [p for p, _ in found if p]
    assert {"my-envs/my_envs/__init__.py", "my-envs/my_envs/words.jsonl", "my-envs/pyproject.toml"} <= set(
        paths
    )
    env_lines = found[paths.index("my-envs/my_envs/__init__.py")][1].splitlines()
    assert len(env_lines) <= 70, "the tutorial's env should stay small"
    assert sum(1 for p, _ in found if p is None) >= 2


def test_the_tutorial_runs_as_written(workdir: Path) -> None:
    outputs: dict[str, str] = {}
    for path, body in blocks():
        if path is not None:
            target = workdir / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(body)
            continue
        for line in body.splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            done = subprocess.run(
                shlex.split(line, comments=True),
                cwd=workdir,
                env=_env(),
                capture_output=True,
                text=True,
                timeout=600,
                check=False,
            )
            out = done.stdout + done.stderr
            assert done.returncode == 0, f"`{line}` exited {done.returncode}:\n{out[-3000:]}"
            outputs[line] = out
    trains = {line: out for line, out in outputs.items() if line.startswith("steprl train")}
    assert len(trains) == 4
    for line, out in trains.items():
        assert "RL-trained : success" in out, line
    # one warm start: by entry point, by import path and with --plugin it is the same env (the
    # first run builds it unless an earlier run of this test left it in the suite's cache)
    policies = [
        re.search(r"policy: (?:fresh SFT \(cached to |cached SFT \()(\S+?)\)", out) for out in trains.values()
    ]
    assert all(policies) and len({p.group(1) for p in policies if p}) == 1, policies
    assert all("cached SFT" in out for out in list(trains.values())[1:]), policies
    backends = [re.search(r"on the (\w+) backend", out) for out in trains.values()]
    assert sorted(m.group(1) for m in backends if m) == ["http", "inprocess", "inprocess", "ray"]
    assert any("reverse: ok" in out for line, out in outputs.items() if line.startswith("steprl check-env"))
    assert (workdir / "runs" / "reverse_tiny" / "checkpoints" / "latest" / "config.yaml").exists()

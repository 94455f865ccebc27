"""The suite's forked `steprl` (tests/cli_zygote.py) is the console script: the same exit code and
output as a real subprocess, the command's own cwd, environment and signals, and a real
subprocess whenever the environment would change what an import reads."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import cli_zygote
from cli_zygote import STEPRL, Forked


def _both(args: list[str], cwd: Path, env: dict[str, str]) -> tuple[object, object]:
    forked = cli_zygote.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    real = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False)
    return (forked.returncode, forked.stdout, forked.stderr), (real.returncode, real.stdout, real.stderr)


def test_a_forked_command_exits_and_prints_as_the_console_script(tmp_path: Path) -> None:
    env = {**os.environ, "COLUMNS": "400"}
    (tmp_path / "bad.yaml").write_text("rollout:\n  group_size: '8'\n")
    for args in (
        [STEPRL, "train", "bad.yaml"],  # a config error: one line, exit 2, relative to cwd
        [STEPRL, "check-env", "calculator", "--tasks", "2"],  # a command that works: exit 0
        [STEPRL, "no-such-command"],  # typer's usage error
    ):
        forked, real = _both(args, tmp_path, env)
        assert forked == real, args


def test_a_signal_reaches_the_forked_command_and_its_exit_says_so(tmp_path: Path) -> None:
    script = tmp_path / "sleepy.py"  # a plugin that blocks the command at import
    script.write_text("import time\nprint('ready', flush=True)\ntime.sleep(60)\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    proc = cli_zygote.popen(
        [STEPRL, "check-env", "calculator", "--plugin", "sleepy"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert isinstance(proc, Forked) and proc.stdout is not None
    assert proc.stdout.readline() == "ready\n"  # its PYTHONPATH was the command's
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGTERM and time.monotonic() - started < 10, out


def test_an_environment_read_at_import_gets_a_real_subprocess(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf")}  # huggingface_hub reads it at import
    proc = cli_zygote.popen([STEPRL, "--help"], env=env, stdout=subprocess.DEVNULL)
    assert not isinstance(proc, Forked)
    assert proc.wait(timeout=120) == 0

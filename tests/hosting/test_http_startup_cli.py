"""`runtime.backend: http` start-up errors through the CLI (issue 23, item 15): a missing token
and an unreachable server are each one line naming the fix, exit 2, where they were tracebacks.
The two `steprl train` processes run at once (each spends its seconds importing the trainer).
A wrong token and an env the server does not serve raise the same `EnvServerError` (a
`UserError`, which the CLI prints alike): tests/hosting/test_env_faults.py checks their lines."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from cli_runs import assert_one_line, run_steprl
from steprl.hosting.local_server import free_port

TOKEN_VAR = "STEPRL_TEST_ENV_TOKEN"


def _train(tmp_path: Path, name: str, url: str, token_var: str) -> tuple[int, str]:
    config = tmp_path / f"{name}.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "run": {"name": name, "output_dir": str(tmp_path / "runs")},
                "env": {"name": "calculator"},
                "runtime": {"backend": "http", "env_server_url": url, "env_token_var": token_var},
                "logging": {"tensorboard": False, "progress": False},
            }
        )
    )
    return run_steprl(["train", str(config)], tmp_path)


def test_a_missing_token_and_an_unreachable_server_are_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TOKEN_VAR, "some-token-long-enough-for-a-server")
    monkeypatch.delenv("STEPRL_TEST_NO_SUCH_VAR", raising=False)
    nobody = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with ThreadPoolExecutor(2) as pool:
        missing, unreachable = pool.map(
            lambda args: _train(tmp_path, *args),
            [("missing", nobody, "STEPRL_TEST_NO_SUCH_VAR"), ("unreachable", nobody, TOKEN_VAR)],
        )
    assert_one_line(*missing, "STEPRL_TEST_NO_SUCH_VAR is empty", "export the server's bearer token")
    assert_one_line(*unreachable, f"cannot reach env server {nobody}", "runtime.env_server_url")

"""Which envs the env server builds for a request (issue 23, item 7).

By default only envs its operator registered (built-ins, --plugin modules, installed entry
points): an import path (`os:abort` killed the server) or a family (gym, mcp: their params
name a module or a command) is refused with a 403 saying how to allow it, and the server stays
up. `--allow-import-paths` serves them; the trainer's own loopback server gets it when the run's
env is one.
"""

from __future__ import annotations

import pytest
from http_helpers import PLUGIN_ENV, http, wire_task

from steprl.config import RuntimeSection
from steprl.hosting.backend import make_backend
from steprl.hosting.local_server import LocalEnvServer

IMPORT_PATH = "plugin_env_for_tests:SPEC"  # an EnvSpec in tests/hosting (on the server's PYTHONPATH)


def test_an_import_path_or_a_family_is_refused_and_the_server_stays_up() -> None:
    with LocalEnvServer(extra_env=PLUGIN_ENV) as server, http(server) as c:
        for env, params in (("os:abort", {}), (IMPORT_PATH, {}), ("mcp", {"command": "sh"})):
            r = c.post("/v1/envs", json={"env": env, "params": params})
            assert r.status_code == 403, r.text
            error = r.json()["error"]
            assert error["type"] == "env_not_served"
            assert "--allow-import-paths" in error["message"] and "--plugin" in error["message"]
        batched = c.post("/v1/batch", json={"calls": [{"op": "create", "body": {"env": "os:abort"}}]})
        assert batched.json()["results"][0]["status"] == 403
        assert server.healthy() and server.running
        assert c.post("/v1/envs", json={"env": "calculator"}).status_code == 200  # registered: served


def test_with_allow_import_paths_an_import_path_env_is_served() -> None:
    with LocalEnvServer(extra_env=PLUGIN_ENV, allow_import_paths=True) as server, http(server) as c:
        created = c.post("/v1/envs", json={"env": IMPORT_PATH})
        assert created.status_code == 200, created.text
        instance = created.json()["instance_id"]
        reset = c.post(f"/v1/envs/{instance}/reset", json={"task": wire_task("tools_at_reset"), "seed": 0})
        assert reset.status_code == 200 and reset.json()["system_prompt"] == "tools for tools_at_reset-0"


def test_the_trainers_own_server_serves_the_runs_import_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", PLUGIN_ENV["PYTHONPATH"])  # inherited by the server it starts
    monkeypatch.syspath_prepend(PLUGIN_ENV["PYTHONPATH"].split(":")[0])
    backend = make_backend(IMPORT_PATH, {}, RuntimeSection(backend="http", env_call_timeout_s=10.0))
    try:
        assert backend.make_env(None).system_prompt == "no tools yet"  # learnt by the start-up probe
    finally:
        backend.close()

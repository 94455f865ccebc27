"""Plugins reach every process that builds envs, and the system prompt an env learns at reset
reaches the first prompt, on all three backends (issue 11)."""

from __future__ import annotations

import asyncio
from itertools import islice
from pathlib import Path

import pytest

from steprl.config import RuntimeSection
from steprl.engines.base import SamplingParams
from steprl.engines.scripted import ScriptedEngine
from steprl.hosting.backend import make_backend
from steprl.hosting.pool import EnvPool
from steprl.rollout.chat import PlainFormat
from steprl.rollout.context import AppendOnly
from steprl.rollout.loop import Budgets, RolloutSetup, rollout_groups

PLUGIN = "plugin_env_for_tests"  # tests/hosting/plugin_env_for_tests.py


@pytest.mark.parametrize("backend_name", ["inprocess", "http", "ray"])
def test_a_plugin_env_with_its_reset_time_system_prompt(
    backend_name: str, tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the env server is a subprocess: it finds the plugin module the way a user's would be found
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    runtime = RuntimeSection(backend=backend_name, env_workers=1, env_call_timeout_s=20.0)
    backend = make_backend("tools_at_reset", {}, runtime, plugins=(PLUGIN,))
    try:
        from plugin_env_for_tests import tasks

        fmt = PlainFormat(tokenizer, system_prompt="env")
        engine = ScriptedEngine(
            ["<answer>ok</answer>"], lambda s: tokenizer.encode(s, add_special_tokens=False)
        )
        setup = RolloutSetup(
            EnvPool(backend, 8).make_env, engine, fmt, AppendOnly(), SamplingParams(), Budgets(max_turns=2)
        )
        batch = list(islice(tasks("train", 0), 3))
        groups = asyncio.run(rollout_groups(batch, 2, setup, seed=1))
    finally:
        backend.close()
    for group in groups:
        for traj in group.trajectories:
            assert traj.outcome_reward == 1.0, traj.info
            first = fmt.decode(traj.steps[0].prompt_ids)
            assert first == f"tools for {group.task.id}\n{group.task.prompt}\n"


def test_ray_workers_load_a_plugin_the_driver_found_after_ray_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workers get the driver's sys.path with the factory: a plugin module next to the
    config (not installed) loads there even when Ray was started before it was on the path."""
    from steprl.hosting.ray_backend import RayEnvBackend, ensure_ray

    ensure_ray()
    source = (Path(__file__).parent / "plugin_env_for_tests.py").read_text()
    (tmp_path / "late_plugin_env.py").write_text(source.replace('"tools_at_reset"', '"late_tools_at_reset"'))
    monkeypatch.syspath_prepend(str(tmp_path))
    backend = make_backend(
        "late_tools_at_reset", {}, RuntimeSection(backend="ray", env_workers=1), plugins=("late_plugin_env",)
    )
    assert isinstance(backend, RayEnvBackend)
    try:
        from late_plugin_env import tasks

        task = next(tasks("train", 0))

        async def episode() -> str:
            env = backend.make_env(task)
            try:
                await env.reset(task, 0)
                return env.system_prompt
            finally:
                await env.close()

        assert asyncio.run(episode()) == f"tools for {task.id}"
    finally:
        backend.close()

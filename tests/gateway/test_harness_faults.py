"""Harness envs under fault injection (issue 44, items 8 and 15), each through `steprl` as a user
runs it (`cli.main` in-process) on the shipped config (configs/harness_calculator_tiny.yaml) at
the smallest shape: the one-layer tiny model from scratch, 2 tasks x 2 episodes, 2 held-out tasks.

* Every evaluation runs the harness as the first did: the same held-out tasks with the same
  seeds open the same gateway sessions again (they used to be refused as over, every held-out
  episode `infra_failed` from the second evaluation on, rc 1 after the whole run).
* A run whose evaluation fails stops after the one at step 0 with one line, not at its end.
* `steprl check-env` passes the shipped harness config (its tasks carry the env's name).
* Renaming the harness function reuses the warm start (which never runs the harness).
* A harness that sends a system prompt the warm start's demonstrations lack is named in one
  line at the first evaluation.
* A harness whose calls land in another session is one `infra_failed` episode naming it.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from steprl import cli
from steprl.engines.base import SamplingParams
from steprl.engines.scripted import ScriptedEngine
from steprl.envs.harness_play import calculator, play
from steprl.envs.registry import make_env
from steprl.envs.spec import Harness
from steprl.gateway.harness_runner import HarnessRunner
from steprl.models import tiny
from steprl.rollout.chat_format import ChatFormat
from steprl.rollout.context import AppendOnly
from steprl.rollout.loop import Budgets, RolloutSetup, rollout_groups
from steprl.types import EndReason, Task

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "harness_calculator_tiny.yaml")
MODEL = (
    "model.tiny.hidden_size=32",
    "model.tiny.num_layers=1",
    "model.tiny.num_heads=2",
    "model.tiny.intermediate_size=64",
)
RUN = (
    "rollout.max_turns=2",
    "rollout.max_tokens_per_turn=8",
    "rollout.tasks_per_step=2",
    "rollout.group_size=2",
    "trainer.eval_tasks=2",
    "logging.progress=false",
    "logging.tensorboard=false",
    "logging.save_trajectories=false",
)
SCRATCH = (*MODEL, "model.init=scratch", *RUN)
#: the warm start at its smallest (two SFT steps on 8 demonstrations)
TINY_SFT = (
    *MODEL,
    "model.sft.skill_steps=2",
    "model.sft.steps=0",
    "model.sft.num_episodes=8",
    "model.sft.batch_size=4",
)


async def fails_held_out(task: Task, client: Any) -> float:
    """The calculator harness, whose held-out tasks reach a service that is down."""
    if "-eval-" in task.id:
        raise ConnectionError("the held-out grader is down")
    return await calculator(task, client)


async def with_system_prompt(task: Task, client: Any) -> float:
    """The calculator harness that sends the env's system prompt first."""
    return await play("calculator", task, client, system=True)


def _steprl(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *argv: str
) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["steprl", *argv])
    monkeypatch.setenv("COLUMNS", "400")  # rich wraps at the terminal width
    with pytest.raises(SystemExit) as done:
        cli.main()
    captured = capsys.readouterr()
    return int(done.value.code or 0), (captured.out + captured.err).strip()


def _sets(*settings: str) -> list[str]:
    return [a for s in settings for a in ("--set", s)]


def _evals(run_dir: Path) -> dict[int, dict[str, float]]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {int(m["step"]): m for m in lines if "eval/tasks" in m}


@pytest.mark.e2e
def test_every_evaluation_runs_the_harness_as_the_first_did(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = [*SCRATCH, f"run.output_dir={tmp_path}", "trainer.total_steps=1", "trainer.eval_every=1"]
    rc, out = _steprl(monkeypatch, capsys, "train", CONFIG, *_sets(*settings))
    assert rc == 0, out
    evals = _evals(tmp_path / "harness_calculator_tiny")
    assert sorted(evals) == [0, 1]
    for m in evals.values():  # two evaluations of the same two tasks, none failed
        assert m["eval/tasks"] == 2.0 and m["eval/infra_failed"] == 0.0, m


@pytest.mark.e2e
def test_a_run_that_cannot_evaluate_stops_after_the_first_evaluation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    settings = [
        *SCRATCH,
        f"run.output_dir={tmp_path}",
        "trainer.total_steps=3",
        "trainer.eval_every=0",
        "env.params.run=test_harness_faults:fails_held_out",
    ]
    rc, out = _steprl(monkeypatch, capsys, "train", CONFIG, *_sets(*settings))
    last = out.splitlines()[-1]
    assert rc == 1 and "Traceback" not in out, out
    assert "evaluation at step 0 failed: 2/2" in last and "the held-out grader is down" in last, out
    steps = [json.loads(x)["step"] for x in (tmp_path / "harness_calculator_tiny" / "metrics.jsonl").open()]
    assert steps == [0], steps  # no RL step was spent on a run whose evaluation cannot work


def test_check_env_passes_the_shipped_harness_config(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out = _steprl(monkeypatch, capsys, "check-env", CONFIG, "--tasks", "2")
    assert rc == 0 and "harness: ok" in out, out


@pytest.mark.e2e
def test_renaming_the_harness_function_reuses_the_warm_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    base = [*TINY_SFT, f"run.output_dir={tmp_path / 'runs'}", f"model.cache_dir={tmp_path / 'cache'}"]
    rc, first = _steprl(monkeypatch, capsys, "sft", CONFIG, *_sets(*base))
    assert rc == 0 and "none cached" in first, first
    renamed = [*base, "env.params.run=test_harness_faults:fails_held_out", "env.params.timeout_s=60"]
    rc, second = _steprl(monkeypatch, capsys, "sft", CONFIG, *_sets(*renamed))
    assert rc == 0 and "SFT warm start: reusing" in second, second


@pytest.mark.e2e
def test_a_harness_system_prompt_the_demonstrations_lack_is_named_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    settings = [
        *TINY_SFT,
        *RUN,
        f"run.output_dir={tmp_path}",
        f"model.cache_dir={tmp_path / 'cache'}",
        "trainer.total_steps=1",
        "trainer.eval_every=0",
        "env.params.run=test_harness_faults:with_system_prompt",
    ]
    rc, out = _steprl(monkeypatch, capsys, "train", CONFIG, *_sets(*settings))
    assert rc == 0, out
    flat = " ".join(out.split())  # rich wraps long lines at the console's width
    assert flat.count("the demonstrations do not show (rollout.system_prompt=none)") == 1, out
    assert "WARNING evaluation at step 0: the harness sends a system prompt" in flat, out
    # the same harness with the demonstrations' system prompt set to the env's: nothing to say
    rc, out = _steprl(monkeypatch, capsys, "train", CONFIG, *_sets(*settings, "rollout.system_prompt=env"))
    assert rc == 0 and "rollout.system_prompt" not in out, out


async def calls_elsewhere(task: Task, client: Any) -> float:
    """A harness whose client names a session of its own (an `x-session-id` header)."""
    other = client.with_options(default_headers={"x-session-id": "my-agent"})
    messages = [{"role": "user", "content": "1+1"}]
    while True:  # until the gateway refuses a call past the turn budget (in that other session)
        reply = await other.chat.completions.create(model="m", messages=messages)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content}]
        messages += [{"role": "user", "content": "more"}]


def test_calls_that_land_in_another_session_are_named(fmt: ChatFormat) -> None:
    engine = ScriptedEngine(["4</s>"] * 8, encode=lambda s: fmt.template_ids(s))
    runner = HarnessRunner(Harness(calls_elsewhere, "tests:calls_elsewhere", 10.0))
    setup = RolloutSetup(
        lambda task: make_env("calculator"),
        engine,
        fmt,
        AppendOnly(),
        SamplingParams(temperature=1.0),
        Budgets(3, 8, 512),
        runner_for=lambda task: runner,
    )
    groups = asyncio.run(rollout_groups([Task(id="t", prompt="1+1", env="harness")], 1, setup, seed=0))
    traj = groups[0].trajectories[0]
    assert traj.end is EndReason.INFRA_FAILED
    error = str(traj.info["error"])
    assert "my-agent" in error and "x-session-id" in error and "runner failed" not in error, error
    gateway, _ = next(iter(runner._gateways.values()))
    assert gateway.sessions == {}  # the other session is not left behind


@pytest.fixture(scope="module")
def fmt() -> ChatFormat:
    tok = tiny.build_tokenizer()
    tok.chat_template = (ROOT / "configs" / "templates" / "tiny_chat.jinja").read_text()
    return ChatFormat(tok, system_prompt="none")

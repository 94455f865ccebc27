"""ATIF export and import (steprl.diagnostics.atif): bit for bit on real episodes, an ordinary
ATIF v1.7 document to its readers, and `steprl export` through the CLI."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cli_runs import ROOT, TINY_SCRATCH, assert_one_line, run_steprl
from steprl.diagnostics.atif import SCHEMA_VERSION, export_run, import_atif, to_atif
from steprl.diagnostics.sinks import TrajectoryWriter, read_trajectories
from steprl.envs.registry import make_tasks
from steprl.errors import UserError
from steprl.rollout.context import AppendOnly
from steprl.rollout.views import packed_view
from steprl.types import EndReason, Trajectory

# The RFC's objects (v1.7) and their fields; the ones marked required must be there. A field
# outside these is not ATIF (its readers reject it): steprl's own data goes in the extras.
ROOT_FIELDS = {"schema_version": 1, "agent": 1, "steps": 1, "session_id": 0, "trajectory_id": 0}
ROOT_FIELDS |= {"notes": 0, "final_metrics": 0, "continued_trajectory_ref": 0, "extra": 0}
ROOT_FIELDS |= {"subagent_trajectories": 0}
AGENT_FIELDS = {"name": 1, "version": 1, "model_name": 0, "tool_definitions": 0, "extra": 0}
STEP_FIELDS = {"step_id": 1, "source": 1, "message": 1, "timestamp": 0, "model_name": 0}
STEP_FIELDS |= {"reasoning_effort": 0, "reasoning_content": 0, "tool_calls": 0, "observation": 0}
STEP_FIELDS |= {"metrics": 0, "extra": 0, "llm_call_count": 0, "is_copied_context": 0}
AGENT_ONLY = {"model_name", "reasoning_effort", "reasoning_content", "tool_calls", "metrics"}
METRICS_FIELDS = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0, "cost_usd": 0}
METRICS_FIELDS |= {"prompt_token_ids": 0, "completion_token_ids": 0, "logprobs": 0, "extra": 0}
CALL_FIELDS = {"tool_call_id": 1, "function_name": 1, "arguments": 1, "extra": 0}
RESULT_FIELDS = {"source_call_id": 0, "content": 0, "subagent_trajectory_ref": 0, "extra": 0}
FINAL_FIELDS = {"total_prompt_tokens": 0, "total_completion_tokens": 0, "total_cached_tokens": 0}
FINAL_FIELDS |= {"total_cost_usd": 0, "total_steps": 0, "extra": 0}


def _fields(obj: dict[str, Any], spec: dict[str, int], where: str) -> None:
    assert not set(obj) - set(spec), f"{where}: not ATIF fields {set(obj) - set(spec)}"
    assert {k for k, req in spec.items() if req} <= set(obj), f"{where}: a required field is missing"
    assert all(v is not None for v in obj.values()), f"{where}: a null field (leave it out instead)"


def check_atif(doc: dict[str, Any]) -> None:
    """The RFC's rules that a document of ours can break (field names, required fields, step
    ids 1..n, sources, agent-only fields, tool-call ids, token ids and log-probs aligned)."""
    _fields(doc, ROOT_FIELDS, "root")
    assert doc["schema_version"] == SCHEMA_VERSION
    _fields(doc["agent"], AGENT_FIELDS, "agent")
    _fields(doc["final_metrics"], FINAL_FIELDS, "final_metrics")
    assert [s["step_id"] for s in doc["steps"]] == list(range(1, len(doc["steps"]) + 1))
    for s in doc["steps"]:
        _fields(s, STEP_FIELDS, f"step {s['step_id']}")
        assert s["source"] in ("system", "user", "agent") and isinstance(s["message"], str)
        if s["source"] != "agent":
            assert not AGENT_ONLY & set(s)
        m = s.get("metrics", {})
        _fields(m, METRICS_FIELDS, "metrics")
        assert len(m.get("completion_token_ids", [])) == len(m.get("logprobs", []))
        calls = {c["tool_call_id"] for c in s.get("tool_calls", [])}
        for c in s.get("tool_calls", []):
            _fields(c, CALL_FIELDS, "tool call")
            assert isinstance(c["arguments"], dict)
        for r in s.get("observation", {}).get("results", []):
            _fields(r, RESULT_FIELDS, "observation result")
            assert r.get("source_call_id", next(iter(calls), None)) in calls | {None}
    json.dumps(doc, allow_nan=False)  # strict JSON when the run's numbers are finite


def _learner_view(row: dict[str, Any]) -> tuple[list[int], list[int]]:
    """The packed sequence and loss mask as an ATIF reader rebuilds them from an imported row:
    prompt and observations masked, actions trained (the final observation dropped)."""
    ids, mask = list(row["prompt_ids"]), [0] * len(row["prompt_ids"])
    for act, obs in zip(row["action_ids"], row["observation_ids"], strict=True):
        ids += act + obs
        mask += [1] * len(act) + [0] * len(obs)
    tail = len(row["observation_ids"][-1])
    return (ids[:-tail], mask[:-tail]) if tail else (ids, mask)


@pytest.fixture
def episodes(tmp_path: Path, tokenizer, sample_rollouts, expert_episode) -> tuple[Path, list[Trajectory]]:
    """A run directory whose trajectories come from the real agent loop (a random tiny policy:
    invalid actions and error observations; an expert: tool calls), one of them sampled by two
    policy versions mid-turn, plus an env that failed to start; written with advantages (one
    episode not trained on). Its eval episodes: the same, without text or advantages."""
    task = next(make_tasks("calculator", "train", 5, min_calls=2, max_calls=2))
    sampled = sample_rollouts(AppendOnly(), n_tasks=2, group_size=2, max_tokens_per_turn=10)
    expert = expert_episode("calculator", task)
    last = expert.steps[-1]
    versions = tuple(range(len(last.action_ids)))  # a partial rollout: new weights per token
    expert = dataclasses.replace(
        expert, steps=(*expert.steps[:-1], dataclasses.replace(last, action_versions=versions))
    )
    failed = Trajectory(task.id, "g", "calculator", (), 0.0, EndReason.INFRA_FAILED, {"error": "boom"})
    trajs = [*sampled, expert, failed]
    rng = np.random.default_rng(0)
    advantages = [
        [rng.standard_normal(len(s.action_ids)).astype(np.float32).tolist() for s in t.steps] for t in trajs
    ]
    advantages[0] = None  # filtered out
    with TrajectoryWriter(tmp_path / "trajectories", decode=tokenizer.decode) as w:
        w.write(3, trajs, advantages=advantages)
    with TrajectoryWriter(tmp_path / "eval_trajectories") as w:
        w.write(0, trajs)
    return tmp_path, trajs


def test_export_then_import_is_bit_exact(tmp_path: Path, episodes) -> None:
    run, trajs = episodes
    docs = []
    for split in ("train", "eval"):  # eval: a run saved without text, not trained on
        files = export_run(run, tmp_path / split, eval=split == "eval")
        docs += [json.loads(f.read_text()) for f in files]
        saved = read_trajectories(run / ("trajectories" if split == "train" else "eval_trajectories"))
        back = import_atif(tmp_path / split)
        # every column, ids, log-probs, advantages and versions included, and its type
        assert back.equals(saved) and back.schema == saved.schema
    for doc in docs:
        check_atif(doc)
    rows = import_atif(tmp_path / "train").to_pylist()
    assert rows[0]["advantages"] is None and rows[1]["advantages"] is not None
    assert any(s.get("tool_calls") for d in docs for s in d["steps"])
    assert rows[-2]["token_versions"][-1] == list(range(len(trajs[-2].steps[-1].action_ids)))
    for row, t in zip(rows, trajs, strict=True):  # the learner's sequence and loss mask
        if t.steps:
            view = packed_view(t, 0)
            assert _learner_view(row) == (list(view.input_ids), list(view.loss_mask))
    # what an ATIF reader sees: the prompt and each action's ids and text, the reward in extra
    doc = to_atif(trajs[-2], step=3, decode=str)
    agent = [s for s in doc["steps"] if s["source"] == "agent"]
    assert agent[0]["metrics"]["prompt_token_ids"] == list(trajs[-2].steps[0].prompt_ids)
    assert [s["metrics"]["completion_token_ids"] for s in agent] == [
        list(s.action_ids) for s in trajs[-2].steps
    ]
    assert [s["extra"]["steprl"]["reward"] for s in agent] == [s.reward for s in trajs[-2].steps]
    with pytest.raises(UserError, match="already holds an ATIF export"):
        export_run(run, tmp_path / "train")
    with pytest.raises(UserError, match="not a steprl ATIF export"):
        import_atif(_write(tmp_path / "other.json", {"schema_version": SCHEMA_VERSION, "steps": []}))


def _write(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(json.dumps(doc))
    return path


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("atif_cli")
    sets = [*TINY_SCRATCH, "trainer.total_steps=2", f"run.output_dir={out}", "run.name=r"]
    rc, log = run_steprl(
        ["train", "configs/calculator_tiny.yaml", *[x for s in sets for x in ("--set", s)]], ROOT
    )
    assert rc == 0, log
    return out / "r"


def test_steprl_export_through_the_cli(cli_run: Path, tmp_path: Path) -> None:
    rc, out = run_steprl(["export", str(cli_run), "-o", str(tmp_path / "atif")], ROOT)
    assert rc == 0, out
    saved = read_trajectories(cli_run / "trajectories")
    assert f"{saved.num_rows} episodes" in out and str(tmp_path / "atif") in out
    assert import_atif(tmp_path / "atif").equals(saved)
    assert_one_line(*run_steprl(["export", str(cli_run), "--format", "csv"], ROOT), "--format")

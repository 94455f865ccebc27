"""Trajectories to ATIF and back, loss-free: `steprl export RUN` and `import_atif`.

ATIF (the Agent Trajectory Interchange Format, Harbor RFC 0001, v1.7) is a JSON document per
trajectory that agent tools and viewers read. steprl writes one per episode, so an ATIF
consumer sees an ordinary trajectory, and keeps everything its Parquet row holds (exact token
ids, behaviour log-probs, per-token policy versions, advantages, rewards, infos) where ATIF puts
numbers and custom data, so that `import_atif` gives back the same columns bit for bit.

What goes where (one episode = one Parquet row of `diagnostics.sinks.TRAJECTORY_SCHEMA`):

- root: `schema_version` "ATIF-v1.7"; `session_id` the run's name (run-scoped, as the RFC has
  it); `trajectory_id` `<split>/step_NNNNNN/episode_KKKKK`; `agent` {name "steprl", version,
  model_name: the config's `model.name`}; `notes` (this layout, in a sentence); `final_metrics`
  {total_completion_tokens, total_steps}; `extra.steprl`: the episode's columns (step, task_id,
  group_id, env, end, outcome_reward, info), `split` ("train" / "eval"), `trained` (the learner
  trained on it: its agent steps carry advantages), `text` (the run saved decoded text) and
  `format` (this layout's version). Columns this module does not know go to
  `extra.steprl.columns`, by name.
- step 1, source "user": the first prompt's decoded text (the rendered template, system part
  included) as `message`. Its ids are the first agent step's `metrics.prompt_token_ids`.
- one step per turn, source "agent": `message` the action's decoded text; `metrics`:
  `completion_token_ids` (the action ids, which the learner trains: loss mask 1),
  `logprobs` (the behaviour log-probs, float32 values written exactly), `completion_tokens`,
  and on the first turn `prompt_token_ids` / `prompt_tokens` (later prompts are that prompt
  plus the earlier actions and observations under an append-only context; the Parquet row does
  not store them, so neither does the export); `tool_calls`, where the env's step info says
  the action was a tool call: the tool's name, with `arguments` {} (steprl records the call as
  text, in `message`; the parsed arguments are not kept); `observation`: one result, the env's
  reply as `content` (decoded) and its exact ids in the result's `extra.steprl.token_ids`
  (env and template tokens: loss mask 0), tied to the tool call by `source_call_id`;
  `extra.steprl`: `reward`, `policy_version`, `token_versions` (per action token), `advantages`
  (per action token, when `trained`) and `info` (the step's info).
- A run saved without text (`TrajectoryWriter` without `decode`): each `message` says so, and
  `extra.steprl.text` is false so the import adds no text columns.

An info that JSON writes back differently than the run stored it (not the case for what
steprl writes) is kept as its stored string, `info_json`. Non-finite floats (a NaN reward) are
written as JSON's NaN / Infinity extension, which Python's and JavaScript's JSON readers take.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from steprl.diagnostics.sinks import (
    TEXT_FIELDS,
    TRAJECTORY_SCHEMA,
    read_trajectories,
    trajectory_row,
    write_failed,
)
from steprl.errors import UserError
from steprl.types import Trajectory

SCHEMA_VERSION = "ATIF-v1.7"
#: the version of the layout above (the `extra.steprl` keys); bumped when it changes
FORMAT = 1
AGENT_NAME = "steprl"
_TEXT_NAMES = tuple(name for name, _ in TEXT_FIELDS)
_KNOWN = (*TRAJECTORY_SCHEMA.names, *_TEXT_NAMES)
_NOTES = (
    "Exported by steprl: one agent step per turn; exact token ids in metrics (completion ids are "
    "the trained tokens) and observation results' extra.steprl.token_ids; rewards, policy "
    "versions and advantages in extra.steprl."
)


class AtifImportError(UserError):
    """A file given to `import_atif` is not a steprl ATIF export."""


# ---------------------------------------------------------------------------- row -> ATIF


def _info_out(stored: str | None) -> dict[str, Any]:
    """An info as a JSON object when it reads back to the same stored string, else the string."""
    if stored is not None:
        try:
            value = json.loads(stored)
        except ValueError:
            value = None
        if isinstance(value, dict) and json.dumps(value, sort_keys=True) == stored:
            return {"info": value}
    return {"info_json": stored}


def _info_in(fields: Mapping[str, Any]) -> str | None:
    if "info" in fields:
        return json.dumps(fields["info"], sort_keys=True)
    value = fields.get("info_json")
    return None if value is None else str(value)


def to_atif(
    episode: Mapping[str, Any] | Trajectory,
    *,
    step: int = 0,
    advantages: Sequence[Sequence[float]] | None = None,
    decode: Callable[[Sequence[int]], str] | None = None,
    session_id: str | None = None,
    trajectory_id: str | None = None,
    model_name: str | None = None,
    split: str = "train",
) -> dict[str, Any]:
    """One episode as an ATIF v1.7 document (a JSON-ready dict): a Parquet row (column ->
    value, e.g. from `read_trajectories(...).to_pylist()`) or a `Trajectory` (with the `step`,
    `advantages` and `decode` a `TrajectoryWriter` would take)."""
    row = trajectory_row(episode, step, advantages, decode) if isinstance(episode, Trajectory) else episode
    has_text = "prompt_text" in row
    n_turns = len(row["action_ids"])
    advantages_of = row.get("advantages")
    steps: list[dict[str, Any]] = [
        {
            "step_id": 1,
            "source": "user",
            "message": _text(row, "prompt_text", None, len(row["prompt_ids"])),
        }
    ]
    completion_tokens = 0
    for k in range(n_turns):
        steps.append(_agent_step(row, k, has_text, advantages_of))
        completion_tokens += len(row["action_ids"][k])
    episode_extra: dict[str, Any] = {
        "format": FORMAT,
        "split": split,
        "step": row["step"],
        "task_id": row["task_id"],
        "group_id": row["group_id"],
        "env": row["env"],
        "end": row["end"],
        "outcome_reward": row["outcome_reward"],
        "trained": advantages_of is not None,
        "text": has_text,
        **_info_out(row["info_json"]),
    }
    others = {name: value for name, value in row.items() if name not in _KNOWN}
    if others:
        episode_extra["columns"] = others
    agent: dict[str, Any] = {"name": AGENT_NAME, "version": _steprl_version()}
    if model_name is not None:
        agent["model_name"] = model_name
    doc: dict[str, Any] = {"schema_version": SCHEMA_VERSION}
    if session_id is not None:
        doc["session_id"] = session_id
    if trajectory_id is not None:
        doc["trajectory_id"] = trajectory_id
    doc.update(
        agent=agent,
        steps=steps,
        notes=_NOTES,
        final_metrics={"total_completion_tokens": completion_tokens, "total_steps": len(steps)},
        extra={"steprl": episode_extra},
    )
    return doc


def _steprl_version() -> str:
    # the installed distribution's: `steprl.__version__` is the root package, above this layer
    try:
        return importlib.metadata.version("steprl")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _text(row: Mapping[str, Any], column: str, k: int | None, n_ids: int) -> str:
    """The decoded text of a column (of turn `k`), or, for a run saved without text, a note."""
    if column not in row:
        return f"({n_ids} token ids; the run saved no decoded text)"
    value = row[column] if k is None else row[column][k]
    return "" if value is None else str(value)


def _agent_step(row: Mapping[str, Any], k: int, has_text: bool, advantages: Any) -> dict[str, Any]:
    """Turn `k` of a row as an ATIF agent step."""
    action_ids = list(row["action_ids"][k])
    metrics: dict[str, Any] = {}
    if k == 0:
        metrics["prompt_tokens"] = len(row["prompt_ids"])
        metrics["prompt_token_ids"] = list(row["prompt_ids"])
    metrics.update(
        completion_tokens=len(action_ids),
        completion_token_ids=action_ids,
        logprobs=[float(x) for x in row["action_logprobs"][k]],
    )
    turn_extra: dict[str, Any] = {
        "turn": k + 1,
        "reward": row["rewards"][k],
        "policy_version": row["policy_versions"][k],
        "token_versions": list(row["token_versions"][k]),
    }
    if advantages is not None:
        turn_extra["advantages"] = [float(a) for a in advantages[k]]
    info = _info_out(row["step_info_json"][k])
    turn_extra.update(info)
    step: dict[str, Any] = {
        "step_id": k + 2,
        "source": "agent",
        "message": _text(row, "action_texts", k, len(action_ids)),
        "metrics": metrics,
    }
    call_id = None
    kind = info.get("info", {})
    if isinstance(kind, dict) and kind.get("action_kind") == "tool_call":
        call_id = f"call_{k + 1}"
        call_extra = {"valid": kind.get("tool_call_valid"), "arguments": "in the step's message"}
        step["tool_calls"] = [
            {
                "tool_call_id": call_id,
                "function_name": str(kind.get("tool_name") or "unknown"),
                "arguments": {},
                "extra": {"steprl": call_extra},
            }
        ]
    obs_ids = list(row["observation_ids"][k])
    obs_text = row["observation_texts"][k] if has_text else None
    if obs_ids or obs_text:
        result: dict[str, Any] = {}
        if call_id is not None:
            result["source_call_id"] = call_id
        if obs_text is not None:
            result["content"] = obs_text
        result["extra"] = {"steprl": {"token_ids": obs_ids}}
        step["observation"] = {"results": [result]}
    step["extra"] = {"steprl": turn_extra}
    return step


# ---------------------------------------------------------------------------- ATIF -> row


def from_atif(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The Parquet row (column -> value) of a document `to_atif` wrote: every id, log-prob,
    version, reward, advantage and info as the run stored it."""
    try:
        ep = doc["extra"]["steprl"]
        steps = doc["steps"]
    except (KeyError, TypeError):
        raise AtifImportError(
            "not a steprl ATIF export (no extra.steprl); import_atif reads what `steprl export` wrote"
        ) from None
    if ep.get("format") != FORMAT:
        raise AtifImportError(
            f"steprl ATIF layout {ep.get('format')!r}; this steprl reads layout {FORMAT}: "
            "export the run again with this version"
        )
    turns = [s for s in steps if s.get("source") == "agent"]
    user: Mapping[str, Any] = next((s for s in steps if s.get("source") == "user"), {})
    row: dict[str, Any] = {
        "step": ep["step"],
        "task_id": ep["task_id"],
        "group_id": ep["group_id"],
        "env": ep["env"],
        "end": ep["end"],
        "outcome_reward": ep["outcome_reward"],
        "num_steps": len(turns),
        "prompt_ids": list(turns[0]["metrics"].get("prompt_token_ids", [])) if turns else [],
        "action_ids": [list(s["metrics"]["completion_token_ids"]) for s in turns],
        "action_logprobs": [list(s["metrics"]["logprobs"]) for s in turns],
        "observation_ids": [
            list(_observation(s).get("extra", {}).get("steprl", {}).get("token_ids", [])) for s in turns
        ],
        "rewards": [s["extra"]["steprl"]["reward"] for s in turns],
        "policy_versions": [s["extra"]["steprl"]["policy_version"] for s in turns],
        "token_versions": [list(s["extra"]["steprl"]["token_versions"]) for s in turns],
        "info_json": _info_in(ep),
        "step_info_json": [_info_in(s["extra"]["steprl"]) for s in turns],
        "advantages": [list(s["extra"]["steprl"]["advantages"]) for s in turns] if ep["trained"] else None,
    }
    if ep.get("text"):
        row["prompt_text"] = user.get("message", "")
        row["action_texts"] = [s.get("message", "") for s in turns]
        row["observation_texts"] = [_observation(s).get("content", "") for s in turns]
    row.update(ep.get("columns", {}))
    return row


def _observation(step: Mapping[str, Any]) -> Mapping[str, Any]:
    """The one observation result `to_atif` writes for a turn ({} when the env said nothing)."""
    results = (step.get("observation") or {}).get("results") or [{}]
    first: Mapping[str, Any] = results[0]
    return first


def rows_table(rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    """Rows (column -> value) as a table with the Parquet files' column types: the trajectory
    columns, the text columns where any row has them, then any others (types inferred)."""
    fields = list(TRAJECTORY_SCHEMA)
    if any("prompt_text" in r for r in rows):
        fields += [pa.field(name, typ) for name, typ in TEXT_FIELDS]
    names = {f.name for f in fields}
    extra = [name for r in rows for name in r if name not in names]
    columns: dict[str, pa.Array] = {}
    for f in fields:
        columns[f.name] = pa.array([r.get(f.name) for r in rows], type=f.type)
    for name in dict.fromkeys(extra):
        columns[name] = pa.array([r.get(name) for r in rows])
    return pa.table(columns)


# ---------------------------------------------------------------------------- files


def export_run(run_dir: str | Path, out_dir: str | Path | None = None, *, eval: bool = False) -> list[Path]:
    """Write each saved episode of a run as an ATIF JSON file, `<out_dir>/step_NNNNNN/
    episode_KKKKK.json` (K: the row in its step's Parquet file). Training episodes, or with
    `eval` the held-out evaluation episodes; `out_dir` defaults to `<run_dir>/atif/train` (or
    `.../eval`). Returns the files written, in order."""
    run_dir = Path(run_dir)
    split = "eval" if eval else "train"
    source = run_dir / ("eval_trajectories" if eval else "trajectories")
    files = sorted(source.glob("step_*.parquet")) if source.is_dir() else []
    if not files:
        raise UserError(
            f"{source}: no saved {split} episodes (step_*.parquet); give a run directory "
            + (
                "whose evaluations saved their episodes"
                if eval
                else "run with logging.save_trajectories=true"
            )
        )
    out = Path(out_dir) if out_dir is not None else run_dir / "atif" / split
    if any(out.glob("step_*/episode_*.json")):
        raise UserError(f"{out} already holds an ATIF export; delete it or give -o a new directory")
    session, model_name = _run_identity(run_dir)
    written: list[Path] = []
    for f in files:
        table = read_trajectories(f)
        for i, row in enumerate(table.to_pylist()):
            name = f"{f.stem}/episode_{i:05d}"
            doc = to_atif(
                row, session_id=session, trajectory_id=f"{split}/{name}", model_name=model_name, split=split
            )
            written.append(_write_json(out / f"{name}.json", doc))
    return written


def _run_identity(run_dir: Path) -> tuple[str, str | None]:
    """The run's name (the ATIF session) and its config's `model.name`, if it has a config."""
    model_name = None
    config = run_dir / "config.yaml"
    if config.is_file():
        from steprl.bounded_yaml import load_yaml_bounded  # as yaml was: only when a config is read

        loaded = load_yaml_bounded(config.read_text(encoding="utf-8"), str(config))
        model = loaded.get("model") if isinstance(loaded, dict) else None
        if isinstance(model, dict) and model.get("name") is not None:
            model_name = str(model["name"])
    return run_dir.resolve().name, model_name


def _write_json(path: Path, doc: Mapping[str, Any]) -> Path:
    """Whole or not at all: written under a temporary name, then renamed."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(doc) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise write_failed("an ATIF trajectory", path, exc) from exc
    return path


def _documents(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, document) for a .json file, each line of a .jsonl file, or every such file
    under a directory, in path order (the order `export_run` wrote them)."""
    if path.is_dir():
        for f in sorted(p for p in path.rglob("*") if p.suffix in (".json", ".jsonl") and p.is_file()):
            yield from _documents(f)
        return
    if not path.exists():
        raise AtifImportError(f"{path}: no such file or directory; give what `steprl export` wrote")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        for n, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                yield f"{path}:{n}", _loads(line, f"{path}:{n}")
    else:
        yield str(path), _loads(text, str(path))


def _loads(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise AtifImportError(f"{where} is not JSON ({exc}); give what `steprl export` wrote") from None


def import_atif(path: str | Path) -> pa.Table:
    """Read ATIF documents that `export_run` / `to_atif` wrote (a .json file, a .jsonl file of
    one document a line, or a directory of them) back into the Parquet columns, one row per
    episode: the same table as `read_trajectories` of the files exported."""
    rows = []
    for where, doc in _documents(Path(path)):
        try:
            rows.append(from_atif(doc))
        except AtifImportError as exc:
            raise AtifImportError(f"{where}: {exc}") from None
    if not rows:
        return TRAJECTORY_SCHEMA.empty_table()
    return rows_table(rows)

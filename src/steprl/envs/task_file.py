"""Tasks from a file: one `Task` per row of a JSONL or Parquet file.

`with_task_file(spec, TaskFile(path))` gives any env (a built-in, a Gymnasium id, an MCP
server) the tasks of a file, which is how an env that has no task generator of its own (the
``mcp`` family) gets its tasks (``env.task_file`` in a config). A row becomes a task:

* ``Task.prompt`` from `TaskFile.prompt_field` (a non-empty string, required);
* ``Task.id`` from `TaskFile.id_field` (a string or an integer), else ``<file stem>-<row>``;
* ``Task.params``: every other field (the env and the reward read them there: an ``answer``,
  an expert's ``solution``, ...), JSON values only; ``Task.answer`` is also set from an
  ``answer`` field that holds a string or a number;
* ``Task.seed``: a stable hash of the id; ``Task.env``: the spec's name.

Splits: a `TaskFile.split_field` of ``train`` or ``eval`` puts a row in that split; a row
without one (or null) goes by a sha256 hash of its id, ``eval`` for an `eval_fraction` share.
The train split repeats forever, reshuffled each pass (a pure function of (seed, pass)); eval
is each row once, shuffled by the seed. Here a relative path is relative to the working
directory; `env.task_file.path` in a config file is relative to that file (`steprl.config`
makes it absolute: to the file's directory, or to the working directory when given with --set).

A bad row is a `TaskFileError` (a `UserError`, printed as one line) naming the file, the row
(the line, for JSONL) and the field. The file is read once per process (cached by path and
modification time), however many env instances, workers or evaluations ask for its tasks.
"""

from __future__ import annotations

import datetime
import decimal
import hashlib
import json
import math
import os
import random
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from steprl.bounded_yaml import MAX_DEPTH
from steprl.envs.spec import EnvSpec, TaskFactory
from steprl.errors import UserError
from steprl.types import Task

__all__ = ["TaskFile", "TaskFileError", "file_tasks", "load_task_file", "with_task_file"]

SPLITS = ("train", "eval")
_JSONL = (".jsonl", ".ndjson")
_PARQUET = (".parquet", ".pq")
_TOO_DEEP = f"lists or objects nested deeper than {MAX_DEPTH} levels; flatten the row."


class TaskFileError(UserError):
    """A task file that cannot be read, or a row in it that is not a task (the message says where)."""


@dataclass(frozen=True)
class TaskFile:
    """Where the tasks are and which fields hold what (see the module docstring)."""

    path: str
    prompt_field: str = "prompt"
    id_field: str = "id"
    split_field: str = "split"
    eval_fraction: float = 0.2  # share of rows in eval, for rows without a split

    def __post_init__(self) -> None:
        if not 0.0 < self.eval_fraction < 1.0:
            raise TaskFileError(
                f"task file {self.path}: eval_fraction must be between 0 and 1 (exclusive), got "
                f"{self.eval_fraction}; or give every row a {self.split_field!r} of train or eval."
            )
        fields = (self.prompt_field, self.id_field, self.split_field)
        if len(set(fields)) != len(fields):
            raise TaskFileError(
                f"task file {self.path}: prompt_field, id_field and split_field must differ, got {fields}."
            )


@dataclass(frozen=True)
class _FileTasks:
    """The `TaskFactory` of a task file (a class, not a closure, so that it pickles)."""

    task_file: TaskFile
    env: str

    def __call__(self, split: str, seed: int, **params: Any) -> Iterator[Task]:
        if params:
            raise TaskFileError(
                f"task file {self.task_file.path}: tasks from a file take no task params, got "
                f"{sorted(params)}; remove env.task_params, or put the values in the file's rows."
            )
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}.")
        tasks = load_task_file(self.task_file, self.env)[split]
        if not tasks:
            tf = self.task_file
            raise TaskFileError(
                f"task file {tf.path} has no {split} rows; give some rows {tf.split_field}: {split}"
                + (f", or change eval_fraction (now {tf.eval_fraction})." if split == "eval" else ".")
            )
        return _train_stream(tasks, seed) if split == "train" else _eval_stream(tasks, seed)


def file_tasks(tf: TaskFile, env: str) -> TaskFactory:
    """The `TaskFactory` of `tf`: ``(split, seed) -> tasks`` whose ``Task.env`` is `env`."""
    return _FileTasks(tf, env)


def with_task_file(spec: EnvSpec, tf: TaskFile) -> EnvSpec:
    """`spec` with its tasks taken from `tf` instead of its own generator."""
    return replace(spec, tasks=file_tasks(tf, spec.name))


def _train_stream(tasks: tuple[Task, ...], seed: int) -> Iterator[Task]:
    epoch = 0
    while True:
        order = list(tasks)
        random.Random(f"{seed}/train/{epoch}").shuffle(order)  # a str seed is stable across runs
        yield from order
        epoch += 1


def _eval_stream(tasks: tuple[Task, ...], seed: int) -> Iterator[Task]:
    order = list(tasks)
    random.Random(f"{seed}/eval").shuffle(order)
    yield from order


# --- reading ----------------------------------------------------------------------------------------------

_CACHE: dict[tuple[Any, ...], Mapping[str, tuple[Task, ...]]] = {}
_CACHE_LOCK = threading.Lock()
_CACHE_SIZE = 16


def load_task_file(tf: TaskFile, env: str) -> Mapping[str, tuple[Task, ...]]:
    """The tasks of `tf` by split ({"train": ..., "eval": ...}, file order), read once per version."""
    path = Path(tf.path)
    try:
        stat = path.stat()
    except FileNotFoundError:
        raise TaskFileError(
            f"task file {tf.path} does not exist (looked in {path.absolute()}); a relative path is "
            f"relative to the working directory ({os.getcwd()})."
        ) from None
    except OSError as exc:
        raise TaskFileError(f"task file {tf.path} cannot be read: {exc.strerror or exc}.") from None
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size, tf, env)
    with _CACHE_LOCK:
        cached = _CACHE.get(key)
    if cached is not None:
        return cached
    tasks = _parse(tf, env, path)
    with _CACHE_LOCK:
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = tasks
    return tasks


def _rows(tf: TaskFile, path: Path) -> Iterator[tuple[str, int, object]]:
    """("line" | "row", its 1-based number, the row) for every row of a JSONL | Parquet file."""
    suffix = path.suffix.lower()
    if suffix in _JSONL:
        try:
            with path.open(encoding="utf-8") as f:
                for number, line in enumerate(f, start=1):
                    if not line.strip():
                        continue  # blank lines (a trailing newline, a separator) are not rows
                    try:
                        yield "line", number, json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise TaskFileError(
                            f"task file {tf.path}, line {number}: not valid JSON ({exc.msg} at column "
                            f"{exc.colno}); write one JSON object per line."
                        ) from None
                    except RecursionError:  # json gives up at Python's recursion limit
                        raise TaskFileError(f"task file {tf.path}, line {number}: {_TOO_DEEP}") from None
        except UnicodeDecodeError as exc:
            raise TaskFileError(
                f"task file {tf.path} is not UTF-8 text ({exc.reason}); save it as UTF-8."
            ) from None
    elif suffix in _PARQUET:
        import pyarrow.parquet as pq  # a core dependency; imported when a Parquet file is read

        try:
            table = pq.read_table(path)
        except Exception as exc:  # pyarrow raises several types for a file it cannot read
            raise TaskFileError(f"task file {tf.path} is not a readable Parquet file: {exc}") from None
        for number, row in enumerate(table.to_pylist(), start=1):
            yield "row", number, row
    else:
        raise TaskFileError(
            f"task file {tf.path}: unknown format {suffix or '(no suffix)'!r}; use JSONL (.jsonl, one "
            "JSON object per line) or Parquet (.parquet)."
        )


def _parse(tf: TaskFile, env: str, path: Path) -> Mapping[str, tuple[Task, ...]]:
    splits: dict[str, list[Task]] = {s: [] for s in SPLITS}
    seen: dict[str, str] = {}  # id -> where it was first
    count = 0
    for unit, number, row in _rows(tf, path):
        count += 1
        where = f"{unit} {number}"
        at = f"task file {tf.path}, {where}"
        if not isinstance(row, dict):
            raise TaskFileError(f"{at}: a row must be a JSON object, got {type(row).__name__}.")
        prompt = row.get(tf.prompt_field)
        if tf.prompt_field not in row or prompt is None:
            raise TaskFileError(
                f"{at}: no {tf.prompt_field!r} field; every row needs the prompt (or set prompt_field "
                f"to the field that holds it; this row has {sorted(row)})."
            )
        if not isinstance(prompt, str) or not prompt.strip():
            raise TaskFileError(
                f"{at}, field {tf.prompt_field!r}: the prompt must be a non-empty string, got {prompt!r:.60}."
            )
        task_id = _task_id(row.get(tf.id_field), at, tf, f"{path.stem}-{number}")
        if task_id in seen:
            raise TaskFileError(
                f"{at}, field {tf.id_field!r}: duplicate id {task_id!r} (first at {seen[task_id]}); ids "
                "must be unique."
            )
        seen[task_id] = where
        split = _split(row.get(tf.split_field), task_id, at, tf)
        params = {
            k: _json_value(v, f"{at}, field {k!r}")
            for k, v in row.items()
            if k not in (tf.prompt_field, tf.id_field, tf.split_field)
        }
        answer = params.get("answer")
        digest = hashlib.sha256(task_id.encode("utf-8", "surrogatepass")).digest()
        splits[split].append(
            Task(
                id=task_id,
                prompt=prompt,
                env=env,
                seed=int.from_bytes(digest[:4], "big") & 0x7FFFFFFF,
                answer=_answer_text(answer),
                params=params,
            )
        )
    if count == 0:
        raise TaskFileError(
            f"task file {tf.path} has no rows; add one JSON object per line (or Parquet row)."
        )
    return {s: tuple(tasks) for s, tasks in splits.items()}


def _task_id(value: object, at: str, tf: TaskFile, default: str) -> str:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise TaskFileError(
            f"{at}, field {tf.id_field!r}: an id must be a string or an integer, got {value!r:.60}."
        )
    if isinstance(value, str) and not value:
        raise TaskFileError(
            f"{at}, field {tf.id_field!r}: the id is empty; give a non-empty id or leave it out."
        )
    return str(value)


def _split(value: object, task_id: str, at: str, tf: TaskFile) -> str:
    if value is None:
        digest = hashlib.sha256(task_id.encode("utf-8", "surrogatepass")).digest()
        return "eval" if int.from_bytes(digest[:8], "big") / 2**64 < tf.eval_fraction else "train"
    if value not in SPLITS:
        raise TaskFileError(
            f"{at}, field {tf.split_field!r}: the split must be train or eval, got {value!r:.60}."
        )
    return str(value)


def _json_value(value: Any, at: str, depth: int = 1) -> Any:
    """`value` as JSON data: Parquet dates and decimals become strings; other non-JSON values are
    errors, and so is nesting deeper than `MAX_DEPTH` (that deep, this walk, and every one after
    it in the env and the reward, would end in a RecursionError)."""
    if depth > MAX_DEPTH:
        raise TaskFileError(f"{at}: {_TOO_DEEP}")
    if value is None or isinstance(value, str | bool | int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise TaskFileError(f"{at}: {value} is not a JSON number; use null or a finite number.")
        return value
    if isinstance(value, list | tuple):
        return [_json_value(v, at, depth + 1) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_value(v, at, depth + 1) for k, v in value.items()}
    if isinstance(value, datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, decimal.Decimal | datetime.timedelta):
        return str(value)
    raise TaskFileError(
        f"{at}: a {type(value).__name__} value is not JSON data (Task.params reach the env and the "
        "reward as JSON); store it as a string or a number."
    )


def _answer_text(answer: object) -> str | None:
    if isinstance(answer, str):
        return answer
    if isinstance(answer, int | float) and not isinstance(answer, bool):
        return str(answer)
    return None

"""Tasks from files (`steprl.envs.task_file`): rows to tasks, splits, streams, errors, the cache."""

from __future__ import annotations

import json
import os
import pickle
from itertools import islice
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from steprl.envs import task_file
from steprl.envs.registry import get_spec
from steprl.envs.task_file import TaskFile, TaskFileError, file_tasks, load_task_file, with_task_file
from steprl.errors import UserError
from steprl.types import Task


def _jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _rows(n: int, **extra: Any) -> list[dict[str, Any]]:
    return [{"id": f"q{i}", "prompt": f"question {i}?", "answer": str(i), **extra} for i in range(n)]


def test_rows_become_tasks_with_params_answer_seed_and_env(tmp_path):
    path = _jsonl(
        tmp_path / "qa.jsonl",
        [
            {"id": "a", "prompt": "2+2?", "answer": 4, "split": "train", "solution": [{"name": "add"}]},
            "",  # a blank line is not a row
            {"prompt": "capital of France?", "answer": "Paris", "split": "eval", "tags": {"geo": True}},
        ],
    )
    tasks = load_task_file(TaskFile(str(path)), "my-env")
    (first,), (second,) = tasks["train"], tasks["eval"]
    assert first == Task(
        id="a",
        prompt="2+2?",
        env="my-env",
        seed=first.seed,
        answer="4",
        params={"answer": 4, "solution": [{"name": "add"}]},
    )
    assert second.id == "qa-3" and second.answer == "Paris"  # no id: <file stem>-<line>
    assert second.params == {"answer": "Paris", "tags": {"geo": True}}
    assert 0 <= first.seed < 2**31 and first.seed != second.seed
    json.dumps([dict(t.params) for t in (first, second)])  # JSON-friendly
    # The seed is a function of the id alone: same id in another file, same seed.
    other = _jsonl(tmp_path / "other.jsonl", [{"id": "a", "prompt": "something else", "split": "train"}])
    assert load_task_file(TaskFile(str(other)), "x")["train"][0].seed == first.seed


def test_custom_field_names(tmp_path):
    path = _jsonl(tmp_path / "t.jsonl", [{"key": 7, "question": "q?", "fold": "eval", "split": "kept"}])
    tf = TaskFile(str(path), prompt_field="question", id_field="key", split_field="fold")
    (task,) = load_task_file(tf, "e")["eval"]
    assert (task.id, task.prompt, dict(task.params)) == ("7", "q?", {"split": "kept"})


def test_hash_split_is_stable_and_near_the_fraction(tmp_path):
    path = _jsonl(tmp_path / "many.jsonl", _rows(1000))
    tasks = load_task_file(TaskFile(str(path), eval_fraction=0.2), "e")
    share = len(tasks["eval"]) / 1000
    assert 0.16 < share < 0.24
    assert {t.id for t in tasks["train"]}.isdisjoint(t.id for t in tasks["eval"])
    again = load_task_file(TaskFile(str(path), eval_fraction=0.2), "e")  # a pure function of the ids
    assert [t.id for t in again["eval"]] == [t.id for t in tasks["eval"]]
    mixed = _jsonl(tmp_path / "mixed.jsonl", [*_rows(50), {"id": "pinned", "prompt": "p", "split": "eval"}])
    assert "pinned" in {t.id for t in load_task_file(TaskFile(str(mixed)), "e")["eval"]}


def test_train_repeats_reshuffled_and_eval_is_finite(tmp_path):
    rows = [{**r, "split": "train" if i < 6 else "eval"} for i, r in enumerate(_rows(10))]
    tasks = file_tasks(TaskFile(str(_jsonl(tmp_path / "t.jsonl", rows))), "e")
    train = [t.id for t in islice(tasks("train", 0), 18)]
    passes = [train[0:6], train[6:12], train[12:18]]
    assert all(sorted(p) == [f"q{i}" for i in range(6)] for p in passes)  # each pass is every row once
    assert len({tuple(p) for p in passes}) > 1  # reshuffled between passes
    assert [t.id for t in islice(tasks("train", 0), 18)] == train  # a pure function of (split, seed)
    assert [t.id for t in islice(tasks("train", 1), 18)] != train
    evals = list(tasks("eval", 0))
    assert sorted(t.id for t in evals) == ["q6", "q7", "q8", "q9"]
    assert [t.id for t in tasks("eval", 0)] == [t.id for t in evals]
    assert pickle.loads(pickle.dumps(tasks))("eval", 0) is not None  # the factory pickles (Ray)


def test_parquet(tmp_path):
    import datetime

    table = pa.table(
        {
            "id": ["p1", "p2"],
            "prompt": ["first?", "second?"],
            "answer": [1.5, None],
            "when": [datetime.date(2024, 1, 2), datetime.date(2024, 1, 3)],
            "split": ["train", "eval"],
        }
    )
    pq.write_table(table, tmp_path / "t.parquet")
    tasks = load_task_file(TaskFile(str(tmp_path / "t.parquet")), "e")
    (train,), (ev,) = tasks["train"], tasks["eval"]
    assert train.params == {"answer": 1.5, "when": "2024-01-02"} and train.answer == "1.5"
    assert ev.params == {"answer": None, "when": "2024-01-03"} and ev.answer is None
    bad = pa.table({"prompt": ["ok?", None]})
    pq.write_table(bad, tmp_path / "bad.parquet")
    with pytest.raises(TaskFileError, match=r"bad\.parquet, row 2: no 'prompt' field"):
        load_task_file(TaskFile(str(tmp_path / "bad.parquet")), "e")


@pytest.mark.parametrize(
    ("lines", "pattern"),
    [
        (['{"prompt": "ok"}', "{not json"], r"line 2: not valid JSON .*one JSON object per line"),
        (['{"prompt": "ok"}', '["a list"]'], r"line 2: a row must be a JSON object, got list"),
        (['{"id": "x", "question": "?"}'], r"line 1: no 'prompt' field.*\['id', 'question'\]"),
        (['{"prompt": 3}'], r"line 1, field 'prompt': the prompt must be a non-empty string, got 3"),
        (['{"prompt": "  "}'], r"line 1, field 'prompt': the prompt must be a non-empty string"),
        (
            ['{"id": "a", "prompt": "p"}', '{"id": "a", "prompt": "q"}'],
            r"line 2, field 'id': duplicate id 'a' \(first at line 1\)",
        ),
        (['{"id": 1.5, "prompt": "p"}'], r"line 1, field 'id': an id must be a string or an integer"),
        (
            ['{"prompt": "p", "split": "test"}'],
            r"line 1, field 'split': the split must be train or eval, got 'test'",
        ),
        (['{"prompt": "p", "x": NaN}'], r"line 1, field 'x': nan is not a JSON number"),
        ([""], r"has no rows"),
    ],
)
def test_malformed_rows_name_the_file_line_and_field(tmp_path, lines, pattern):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TaskFileError, match=pattern) as caught:
        load_task_file(TaskFile(str(path)), "e")
    assert str(path) in str(caught.value) and isinstance(caught.value, UserError)
    assert "\n" not in str(caught.value)  # the CLI prints one line


def test_missing_file_unknown_format_and_empty_split(tmp_path):
    with pytest.raises(
        TaskFileError, match=r"nope\.jsonl does not exist \(looked in .*relative to the working"
    ):
        load_task_file(TaskFile(str(tmp_path / "nope.jsonl")), "e")
    (tmp_path / "t.csv").write_text("prompt\nhi\n")
    with pytest.raises(TaskFileError, match=r"unknown format '\.csv'; use JSONL"):
        load_task_file(TaskFile(str(tmp_path / "t.csv")), "e")
    only_train = file_tasks(TaskFile(str(_jsonl(tmp_path / "t.jsonl", _rows(3, split="train")))), "e")
    assert len(list(islice(only_train("train", 0), 5))) == 5
    with pytest.raises(
        TaskFileError, match=r"has no eval rows; give some rows split: eval, or change eval_fraction"
    ):
        only_train("eval", 0)  # raised at the call, not at the first next()
    with pytest.raises(TaskFileError, match=r"take no task params, got \['hops'\]"):
        only_train("train", 0, hops=2)
    with pytest.raises(TaskFileError, match="eval_fraction must be between 0 and 1"):
        TaskFile("x.jsonl", eval_fraction=1.0)


def test_the_file_is_read_once_per_version(tmp_path, monkeypatch):
    path = _jsonl(tmp_path / "t.jsonl", _rows(5))
    reads: list[Path] = []
    parse = task_file._parse
    monkeypatch.setattr(task_file, "_parse", lambda tf, env, p: reads.append(p) or parse(tf, env, p))
    tf = TaskFile(str(path))
    for _ in range(3):
        list(islice(file_tasks(tf, "e")("train", 0), 3))
    assert len(reads) == 1
    _jsonl(path, _rows(6))
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert len(load_task_file(tf, "e")["train"]) + len(load_task_file(tf, "e")["eval"]) == 6
    assert len(reads) == 2


def test_with_task_file_replaces_only_the_tasks(tmp_path):
    spec = get_spec("calculator")
    path = _jsonl(tmp_path / "calc.jsonl", [{"prompt": "What is 2 + 3?", "answer": "5", "split": "train"}])
    replaced = with_task_file(spec, TaskFile(str(path)))
    (task,) = islice(replaced.tasks("train", 0), 1)
    assert task.env == "calculator" and task.prompt == "What is 2 + 3?"
    assert (replaced.factory, replaced.name, dict(replaced.strategies)) == (
        spec.factory,
        spec.name,
        dict(spec.strategies),
    )

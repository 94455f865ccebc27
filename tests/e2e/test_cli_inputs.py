"""Small command-line defects of issue 23 (items 11 and 18), each through the real `steprl`:

* a quoted number in a config is refused with one line (item 11);
* `check-env` prints a bad task row as one line with exit 2, as `train` does, not a wrapped repr;
* a relative `env.task_file.path` in a config file is relative to that file, so a config runs
  from any directory; one given with `--set` is relative to the working directory.

The commands start together (each pays the torch import; in parallel that is paid once in wall
time).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

import cli_zygote
from cli_runs import STEPRL, assert_one_line
from steprl.config import load_config

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
ROWS = "".join(
    f'{{"prompt": "{a}+{a}", "answer": "{2 * a}"{split}}}\n'
    for a, split in ((1, ""), (2, ""), (3, ', "split": "eval"'))
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str]]:
    tmp = tmp_path_factory.mktemp("cli_inputs")
    (tmp / "bad.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n{"prompt": 3, "answer": "4"}\n')
    (tmp / "bad_row.yaml").write_text(yaml.safe_dump({"env": {"task_file": {"path": "bad.jsonl"}}}))
    (tmp / "quoted.yaml").write_text("rollout:\n  group_size: '8'\n")
    sub = tmp / "configs"
    sub.mkdir()
    (sub / "tasks.jsonl").write_text(ROWS)
    (sub / "relative.yaml").write_text(yaml.safe_dump({"env": {"task_file": {"path": "tasks.jsonl"}}}))
    cases = {
        "quoted": ["check-env", "quoted.yaml"],
        "bad_row": ["check-env", "bad_row.yaml"],
        "relative": ["check-env", "configs/relative.yaml", "--tasks", "2"],  # run from its parent
    }
    env = {**os.environ, "COLUMNS": "400"}
    procs = {
        name: cli_zygote.popen(
            [STEPRL, *argv], cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for name, argv in cases.items()
    }
    outputs = {name: p.communicate(timeout=300)[0] for name, p in procs.items()}
    return {name: (procs[name].returncode, out.strip()) for name, out in outputs.items()}


def test_a_quoted_number_is_one_line(runs: dict[str, tuple[int, str]]) -> None:
    rc, out = runs["quoted"]
    assert_one_line(rc, out, "rollout.group_size", "(got '8')", "allowed values: an integer > 0")


def test_check_env_prints_a_bad_task_row_as_one_line_exit_2(runs: dict[str, tuple[int, str]]) -> None:
    rc, out = runs["bad_row"]
    assert_one_line(rc, out, "bad.jsonl, line 2, field 'prompt'")
    assert "TaskFileError(" not in out and len(out.splitlines()) == 1, out


def test_a_task_file_is_relative_to_its_config_file(runs: dict[str, tuple[int, str]]) -> None:
    rc, out = runs["relative"]
    assert rc == 0 and "calculator: ok" in out, out


def test_a_task_file_given_with_set_is_relative_to_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = load_config(ROOT / "configs" / "mcp_time.yaml")  # the shipped config, from elsewhere
    assert cfg.env.task_file is not None
    assert Path(cfg.env.task_file.path) == ROOT / "configs" / "tasks" / "time_tasks.jsonl"
    given = load_config(ROOT / "configs" / "mcp_time.yaml", ["env.task_file.path=mine.jsonl"])
    assert given.env.task_file is not None and given.env.task_file.path == str(tmp_path / "mine.jsonl")


def test_every_path_in_a_config_file_is_relative_to_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 44 item 11: configs/harness_calculator_tiny.yaml's chat_template resolved only from
    the repository root. Files a config names travel with it (its folder); what a command writes
    (run.output_dir), a Hub id and the vLLM venv (the checkout's) stay as given; a path given
    with --set is the shell's."""
    monkeypatch.chdir(tmp_path)
    shipped = load_config(ROOT / "configs" / "harness_calculator_tiny.yaml")  # from elsewhere
    assert shipped.model.chat_template == str(ROOT / "configs" / "templates" / "tiny_chat.jinja")
    folder = tmp_path / "cfg"
    (folder / "models" / "mine").mkdir(parents=True)
    written = {
        "run": {"output_dir": "runs"},
        "model": {"name": "models/mine", "chat_template": "t.jinja", "cache_dir": "cache"},
        "rollout": {"vllm_python": ".venv-vllm/bin/python"},
        "env": {"mix": [{"name": "calculator", "task_file": {"path": "tasks.jsonl"}}]},
    }
    (folder / "c.yaml").write_text(yaml.safe_dump(written))
    cfg = load_config(folder / "c.yaml")
    assert (cfg.model.name, cfg.model.chat_template, cfg.model.cache_dir) == (
        str(folder / "models" / "mine"),  # a model directory there, not a Hub id
        str(folder / "t.jinja"),
        str(folder / "cache"),
    )
    task_file = cfg.env.mix[0].task_file
    assert task_file is not None and task_file.path == str(folder / "tasks.jsonl")
    assert (cfg.run.output_dir, cfg.rollout.vllm_python) == ("runs", ".venv-vllm/bin/python")
    given = load_config(folder / "c.yaml", ["model.name=org/name", "model.chat_template=mine.jinja"])
    assert given.model.name == "org/name" and given.model.chat_template == str(tmp_path / "mine.jinja")

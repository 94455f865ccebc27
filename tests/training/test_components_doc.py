"""docs/components.md as written: its task source and controller pass the checkers by import
path, a config that names them gets them, and the controller stops on the collapse it watches."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from steprl.config import load_config
from steprl.training.controllers import Controllers, StepReport, check_controller
from steprl.training.sources import make_source, take
from steprl.training.sources.check import check_task_source, synthetic_tasks
from steprl.types import EndReason, Group, Trajectory

DOC = Path(__file__).resolve().parents[2] / "docs" / "components.md"
_FILE = re.compile(r"<!-- file: (?P<path>\S+) -->\n```\w*\n(?P<body>.*?)```", re.S)


@pytest.fixture(scope="module")
def on_path(tmp_path_factory: pytest.TempPathFactory):
    where = tmp_path_factory.mktemp("components_doc")
    for m in _FILE.finditer(DOC.read_text()):
        (where / m.group("path")).write_text(m.group("body"))
    sys.path.insert(0, str(where))
    yield where
    sys.path.remove(str(where))
    sys.modules.pop("my_components", None)


def test_the_doc_source_and_controller_pass_the_checkers(on_path) -> None:
    check_task_source("my_components:RetryUnsolved")
    check_controller("my_components:tool_use_watch", load_config(None, []))


def test_an_unsolved_task_comes_back_once_with_a_new_position(on_path) -> None:
    source = make_source("my_components:RetryUnsolved", lambda: synthetic_tasks(0), 0)
    (index, task), *_ = take(source, 1)
    failed = Trajectory(task.id, "g", task.env, (), 0.0, EndReason.ANSWERED)
    source.observe(Group(task, (failed,)))
    source.observe(Group(task, (failed,)))  # a second chance only once
    later = take(source, 20)
    assert [i for i, t in later if t.id == task.id] == [9]  # due 8 hand-outs after position 1


def test_a_config_names_the_controller_and_it_stops_a_tool_use_collapse(on_path) -> None:
    cfg = load_config(None, ["trainer.controllers=[my_components:tool_use_watch]"])
    controllers = Controllers.for_config(cfg)
    named = ["nonfinite_guard", "failure_guard", "my_components:tool_use_watch"]
    assert list(controllers.members) == ["health", *named]
    rates = [0.4, 0.3, 0.05, 0.0, 0.02]
    stops = [controllers.observe(StepReport(s, {"tools/call_rate": r})).stop for s, r in enumerate(rates, 1)]
    assert stops[:4] == [None] * 4 and stops[4] is not None and "stopped calling its tools" in stops[4]


def test_an_unknown_controller_is_one_line_naming_the_allowed_ones() -> None:
    from steprl.config import ConfigError

    with pytest.raises(ConfigError, match=r"trainer.controllers: unknown controller 'nope'; use one of"):
        Controllers.for_config(load_config(None, ["trainer.controllers=[nope]"]))

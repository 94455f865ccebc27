"""Task sources (training/sources/): every registered one keeps the contract `check_task_source`
states (deterministic, resumable from its state_dict, requeue exactly once); `env.source` is
checked against the registry; the stream hands out exactly the env's train split."""

from __future__ import annotations

from itertools import islice
from typing import Any

import pytest

from steprl.config import ConfigError
from steprl.training.sources import TASK_SOURCES, make_source, take
from steprl.training.sources.check import check_task_source, synthetic_tasks
from steprl.training.sources.stream import StreamSource


@pytest.mark.parametrize("name", sorted(TASK_SOURCES))
def test_every_registered_source_keeps_the_contract(name):
    check_task_source(name)


def test_the_stream_is_the_train_split_in_order_with_positions_from_0():
    """The positions key the episode seeds: they must be exactly what the split's order gives."""
    source = make_source("stream", lambda: synthetic_tasks(5), 5)
    assert take(source, 50) == list(enumerate(islice(synthetic_tasks(5), 50)))


def test_an_unknown_source_is_one_line_naming_the_allowed_ones():
    with pytest.raises(ConfigError, match=r"env.source: unknown task source 'nope'; use one of \['stream'"):
        make_source("nope", lambda: synthetic_tasks(0), 0)
    with pytest.raises(ConfigError, match="env.source 'no_such_module:f': ModuleNotFoundError"):
        make_source("no_such_module:f", lambda: synthetic_tasks(0), 0)


def test_a_source_of_your_own_by_import_path_keeps_the_contract():
    """`env.source: package.module:attr`, as `env.name` takes an env: no edit of TASK_SOURCES."""
    check_task_source("steprl.training.sources.stream:StreamSource")


def test_a_checkpoint_past_the_end_of_the_split_is_refused():
    source = make_source("stream", lambda: islice(synthetic_tasks(0), 3), 0)
    with pytest.raises(ValueError, match="ended at 3 tasks; the checkpoint is at 5"):
        source.load_state_dict({"cursor": 5, "requeued": []})


class _ForgetsRequeued(StreamSource):
    """A source whose state leaves out the tasks given back to it: a resume would lose them."""

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "requeued": []}


class _RequeuesLast(StreamSource):
    """A source that re-issues a given-back task after the new ones, with a new position."""

    def requeue(self, index: int, task: Any) -> None:
        pass


@pytest.mark.parametrize(
    ("broken", "says"),
    [(_ForgetsRequeued, "round trip changed the next 100"), (_RequeuesLast, "came back as")],
)
def test_the_checker_catches_a_source_that_loses_a_requeued_task(monkeypatch, broken, says):
    monkeypatch.setitem(TASK_SOURCES, "broken", broken)
    with pytest.raises(AssertionError, match=says):
        check_task_source("broken")

"""check_env on finite task sets (tasks from a file cycle) and on ids that name two tasks."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from steprl.envs.check import EnvCheckError, check_spec
from steprl.envs.registry import get_spec


def _with_tasks(make):
    return replace(get_spec("calculator"), tasks=make)


def test_a_finite_train_set_that_cycles_is_checked_once_per_task() -> None:
    base = get_spec("calculator")

    def cycling(split: str, seed: int):
        few = list(itertools.islice(base.tasks(split, seed), 3))
        return itertools.cycle(few)

    report = check_spec(_with_tasks(cycling), n_tasks=8)
    assert report.n_tasks == 3
    assert "3 tasks" in report.relaxed["tasks"]


def test_one_id_for_two_tasks_fails() -> None:
    base = get_spec("calculator")

    def same_id(split: str, seed: int):
        for t in base.tasks(split, seed):
            yield replace(t, id=f"calc-{split}")

    with pytest.raises(EnvCheckError, match="task id 'calc-train' names two different tasks"):
        check_spec(_with_tasks(same_id), n_tasks=4)

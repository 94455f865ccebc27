"""Task sources: what the next RL step trains on, as a run component (`training/components.py`).

A source hands out tasks one at a time, each with its stream position: the position keys the
task's episode seeds (`rollout/seeds.py`), so it is part of what makes a run reproducible. The
pipeline (`training/loop/pipeline.py`) takes from it, gives back the task of a group it evicted
(`requeue`: it runs again, first, with its own position), and shows it every group it trains, in
stream order (`observe`: a curriculum learns from success there; the plain stream ignores it).
Its `state_dict` is in the checkpoint, so a resume continues the same stream without replaying it.

A source is built from the run's train splits (`TaskSplits`: one per env, with the env weights)
and the run seed. Called, the splits give one stream of every env's tasks, interleaved by
weight in a fixed order, so a source written for one env (as `stream`) runs on several as is;
`mixture` draws each position's env by weight instead.

A new source is one file here plus one entry in `TASK_SOURCES`; `check_task_source`
(`sources/check.py`) is what the tests run over every entry. A source of your own needs no
edit here: `env.source: package.module:attr` names its class (as `env.name` names an env).
`env.source_params` are the factory's keyword arguments after (tasks, seed), checked against
its signature as `algorithm.*_params` are (e.g. `difficulty`'s thresholds and pool weights).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

from steprl.config import ConfigError
from steprl.registry import Registry, class_with
from steprl.training.components import Stateful
from steprl.training.sources.admission import AdmissionSource
from steprl.training.sources.difficulty import DifficultySource
from steprl.training.sources.learning_progress import LearningProgressSource
from steprl.training.sources.mixture import MixtureSource
from steprl.training.sources.splits import TaskSplits
from steprl.training.sources.stream import StreamSource
from steprl.types import Group, Task


@runtime_checkable
class TaskSource(Stateful, Protocol):
    """The train tasks of a run, with their stream positions."""

    def next(self) -> tuple[int, Task] | None:
        """The next task and its stream position (a re-queued one first, lowest position
        first); None when there is none left."""
        ...

    def requeue(self, index: int, task: Task) -> None:
        """Take back a task handed out at `index` and not trained (evicted, or in flight at a
        checkpoint): `next` gives it again, with the same position, before any new task."""
        ...

    def observe(self, group: Group) -> None:
        """A group of the task's episodes that the learner trains on (called in stream order)."""
        ...


#: (the train splits: called, a fresh iterator over all of them from the start; the run seed,
#: then `env.source_params` as keyword arguments) -> a source
SourceFactory = Callable[..., TaskSource]

#: what a source class of your own must define (`TaskSource`)
_METHODS = ("next", "requeue", "observe", "state_dict", "load_state_dict")

TASK_SOURCES: Registry[SourceFactory] = Registry(
    {
        "stream": StreamSource,  # the train split(s) in order (several: interleaved by weight)
        "mixture": MixtureSource,  # each position's env drawn by weight, from the run seed
        "learning_progress": LearningProgressSource,  # mixture weighted by each env's change in success
        # tasks re-served from easy / normal / hard pools by their last group-mean reward, and new
        # ones (unseen), each position's pool drawn by weight from the run seed
        "difficulty": DifficultySource,
        # a live set admitted by the pass rate of each task's shape, mastered tasks retired and
        # replaced from the stream (a synthesized env's train split never ends: `steprl synth`)
        "admission": AdmissionSource,
    },
    key="env.source",
    what="task source",
    accept=class_with(*_METHODS),
    expected=f"a task source class; name a class (tasks, seed, **params) with {', '.join(_METHODS)} "
    "(TaskSource, docs/components.md)",
    params=lambda factory: factory,
    skip=2,
    checker="steprl.training.sources.check:check_task_source",
)


def make_source(
    name: str,
    tasks: TaskSplits | Callable[[], Iterator[Task]],
    seed: int,
    params: Mapping[str, Any] | None = None,
) -> TaskSource:
    """The source `name` (`env.source`: a name in `TASK_SOURCES`, or the import path
    `package.module:attr` of a class following `TaskSource`) over the train splits `tasks` (a
    bare iterator factory is one env's split), with `params` (`env.source_params`) as its
    keyword arguments."""
    if not isinstance(tasks, TaskSplits):
        tasks = TaskSplits.one(tasks)
    factory = TASK_SOURCES.lookup(name)
    params = dict(params or {})
    try:
        TASK_SOURCES.check_params(name, params)
        return factory(tasks, seed, **params)
    except ValueError as exc:  # the factory's own checks too (say, thresholds out of order)
        msg = str(exc) if str(exc).startswith("env.source_params") else f"env.source_params: {exc}"
        if msg.endswith("allowed keys: "):
            msg += f"none ({name!r} takes no params)"
        raise ConfigError(msg) from None


def take(source: TaskSource, n: int) -> list[tuple[int, Task]]:
    """Up to `n` tasks from `source` (fewer if it runs out), each with its stream position."""
    out: list[tuple[int, Task]] = []
    while len(out) < n and (item := source.next()) is not None:
        out.append(item)
    return out


__all__ = ["TASK_SOURCES", "SourceFactory", "TaskSource", "TaskSplits", "make_source", "take"]

"""Task sources (training/sources/): every registered one keeps the contract `check_task_source`
states (deterministic, resumable from its state_dict, requeue exactly once); `env.source` is
checked against the registry; the stream hands out exactly the env's train split."""

from __future__ import annotations

import re
from collections import Counter, deque
from itertools import islice
from pathlib import Path
from typing import Any

import pytest

from steprl.config import ConfigError
from steprl.training.sources import TASK_SOURCES, make_source, take
from steprl.training.sources.check import ENVS, check_task_source, synthetic_splits, synthetic_tasks
from steprl.training.sources.difficulty import DifficultySource
from steprl.training.sources.stream import StreamSource
from steprl.types import EndReason, Group, Task, Trajectory


@pytest.mark.parametrize("name", sorted(TASK_SOURCES))
def test_every_registered_source_keeps_the_contract(name):
    check_task_source(name)


def test_the_stream_is_the_train_split_in_order_with_positions_from_0():
    """The positions key the episode seeds: they must be exactly what the split's order gives."""
    source = make_source("stream", lambda: synthetic_tasks(5), 5)
    assert take(source, 50) == list(enumerate(islice(synthetic_tasks(5), 50)))


def test_several_envs_share_the_tasks_by_weight_and_one_env_is_the_stream():
    """Weights 1:2: `stream` interleaves exactly (every window of 3 has 1 + 2), `mixture` draws
    (about a third over 3,000); each env's tasks in its split's order; over one env both are the
    split itself, position for position."""
    stream = [t for _, t in take(make_source("stream", synthetic_splits(1), 1), 3000)]
    drawn = [t for _, t in take(make_source("mixture", synthetic_splits(1), 1), 3000)]
    assert [t.env for t in stream[:6]] == [ENVS[1], ENVS[0], ENVS[1]] * 2
    assert sum(t.env == ENVS[0] for t in stream) == 1000
    assert 900 < sum(t.env == ENVS[0] for t in drawn) < 1100
    assert drawn[:6] != stream[:6]  # a draw, not the fixed order
    for tasks in (stream, drawn):
        for env in ENVS:
            mine = [t for t in tasks if t.env == env]
            assert mine == list(islice(synthetic_tasks(1, env), len(mine)))
    one = list(enumerate(islice(synthetic_tasks(5), 50)))
    for name in ("stream", "mixture"):
        assert take(make_source(name, lambda: synthetic_tasks(5), 5), 50) == one


def test_an_env_that_runs_out_leaves_the_mixture_and_a_resume_knows_it():
    short = synthetic_splits(2)
    short = type(short)(
        {ENVS[0]: lambda: islice(synthetic_tasks(2, ENVS[0]), 4), ENVS[1]: short.by_env[ENVS[1]]},
        short.weights,
    )
    for name in ("stream", "mixture"):
        source = make_source(name, short, 2)
        tasks = [t for _, t in take(source, 30)]
        assert sum(t.env == ENVS[0] for t in tasks) == 4 and len(tasks) == 30
        again = make_source(name, short, 2)
        again.load_state_dict(source.state_dict())
        assert take(again, 20) == take(source, 20)


def test_an_unknown_source_is_one_line_naming_the_allowed_ones():
    with pytest.raises(
        ConfigError,
        match=re.escape(f"env.source: unknown task source 'nope'; use one of {sorted(TASK_SOURCES)}"),
    ):
        make_source("nope", lambda: synthetic_tasks(0), 0)
    with pytest.raises(
        ConfigError,
        match="env.source 'no_such_module:f': importing 'no_such_module' failed: ModuleNotFoundError",
    ):
        make_source("no_such_module:f", lambda: synthetic_tasks(0), 0)


def test_a_source_of_your_own_by_import_path_keeps_the_contract():
    """`env.source: package.module:attr`, as `env.name` takes an env: no edit of TASK_SOURCES."""
    check_task_source("steprl.training.sources.stream:StreamSource")


def test_a_checkpoint_past_the_end_of_the_split_is_refused():
    source = make_source("stream", lambda: islice(synthetic_tasks(0), 3), 0)
    with pytest.raises(ValueError, match="ended at 3 tasks; the checkpoint is at 5"):
        source.load_state_dict({"cursor": 5, "requeued": []})


def _scored(task: Task, reward: float) -> Group:
    """A group of two episodes with mean reward `reward` (each episode gets it)."""
    traj = Trajectory(task.id, task.id, task.env, (), reward, EndReason.ANSWERED)
    return Group(task, (traj, traj))


def test_difficulty_pools_re_serve_tasks_by_their_last_group_mean_reward():
    """Each task's reward is fixed by its number: 1.0 (easy), 0.0 (hard) or 0.5 (normal). With
    easy and hard weighted 0, only the normal tasks come back, each with a new position."""
    source = make_source("difficulty", synthetic_splits(4), 4, {"weights": {"easy": 0, "hard": 0}})
    out: list[tuple[int, Task]] = []
    while len(out) < 300:
        got = take(source, 4)
        out += got
        for _, task in got:
            source.observe(_scored(task, (1.0, 0.0, 0.5)[task.params["i"] % 3]))
    assert isinstance(source, DifficultySource)
    assert source.sizes()["easy"] > 0 and source.sizes()["hard"] > 0  # filed, never drawn
    assert [i for i, _ in out] == list(range(len(out)))  # a new position for every hand-out
    seen: set[str] = set()
    for _, task in out:
        if task.id in seen:
            assert task.params["i"] % 3 == 2, f"{task.id} is easy or hard and came back"
        seen.add(task.id)
    again = len(out) - len(seen)
    assert 100 < again < 200  # normal and unseen weighted 1:1 once the normal pool holds tasks


def test_source_params_are_checked_against_the_factory_in_one_line():
    for params, says in [
        ({"esay": 0.8}, "env.source_params: unknown key(s) esay; allowed keys: easy, hard, weights"),
        ({"easy": "high"}, "env.source_params.easy: 'high' is not allowed; allowed values: a number"),
        ({"weights": {"medium": 1}}, "env.source_params: weights: unknown pool(s) medium; allowed: "),
        ({"hard": 0.95}, "env.source_params: hard (0.95) must be below easy (0.9)"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(says)):
            make_source("difficulty", synthetic_splits(0), 0, params)
    with pytest.raises(ConfigError, match=re.escape("easy; allowed keys: none ('stream' takes no params)")):
        make_source("stream", synthetic_splits(0), 0, {"easy": 0.9})


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


def test_a_learner_below_the_band_on_every_shape_gets_its_nearest_tasks_on_probation():
    """`admission` on a synthesized env whose learner is below the band on every shape, yet
    solves some tasks of one shape half the time: after `max_skips` refusals the passed-over
    candidate nearest the band is admitted on probation (not the next one blind), so the set
    keeps the tasks measured in the band; resume-exact through the reserve."""
    from steprl.envs.registry import get_spec
    from steprl.training.sources import TaskSplits
    from steprl.training.sources.admission import AdmissionSource, shape_of

    files = Path(__file__).parents[2] / "configs" / "synth" / "files.yaml"
    spec = get_spec("synth", {"spec": str(files), "allow_written_code": True})  # its copy_mode's code
    few = dict(Counter(shape_of(t) for t in islice(spec.tasks("train", 0), 200)).most_common(3))
    best = next(iter(few))
    splits = TaskSplits.one(lambda: (t for t in spec.tasks("train", 0) if shape_of(t) in few), "synth")

    def make() -> AdmissionSource:
        source = make_source("admission", splits, 0, {"active": 6, "window": 2, "max_skips": 20})
        assert isinstance(source, AdmissionSource)
        return source

    def run(source: AdmissionSource, steps: int) -> list[tuple[str, float]]:
        served = []
        for _ in range(steps):
            item = source.next()
            assert item is not None
            task = item[1]  # of 8 episodes: only `best` is done at all, one task in 4 half the time
            wins = 4 * (shape_of(task) == best and sum(map(ord, task.id)) % 4 == 0)
            trajs = tuple(
                Trajectory(task.id, f"{task.id}-{k}", task.env, (), float(k < wins), EndReason.ANSWERED)
                for k in range(8)
            )
            source.observe(Group(task, trajs))
            served.append((task.id, source.metrics().get("source/pass_rate", 0.0)))
        return served

    source = make()
    run(source, 12)
    assert source.dry and source.reserve  # every shape below the band: admitting from the reserve
    twin = make()
    twin.load_state_dict(source.state_dict())
    served = run(source, 130)
    assert run(twin, 130) == served  # resume-exact through the reserve
    m = source.metrics()
    assert m["source/skipped_hard"] > 0 and m["source/rejected"] > 0 and m["source/admitted_anyway"] > 0
    assert all(rate == 0.5 for _, rate in served[-50:])  # only the half-solved tasks of `best` stay
    assert all(shape_of(t) == best for t in source.active)
    # the nearest: of a reserve of shapes rated 0.0, 0.15 and 0.05, the 0.15 one (band [0.2, 0.8])
    pick = make()
    by_shape = {shape_of(t): t for t in islice(spec.tasks("train", 0), 60)}
    shapes = list(by_shape)[:3]
    pick.shapes = {s: deque([r]) for s, r in zip(shapes, (0.0, 0.15, 0.05), strict=True)}
    pick.reserve = [by_shape[s] for s in shapes]
    assert shape_of(pick._nearest()) == shapes[1] and len(pick.reserve) == 2

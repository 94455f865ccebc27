"""The rollout pipeline (training/loop/pipeline.py): admission window, eviction with re-queue, pending
work, staleness metrics; and the in-process producer against the synchronous rollout."""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections.abc import Coroutine
from typing import Any

import pytest
import torch

from step_helpers import SyncSource, local_rollout
from steprl.engines.base import SamplingParams
from steprl.rollout.loop import Budgets
from steprl.training.loop.pipeline import Finished, Pipeline, staleness_metrics
from steprl.training.loop.producers import LocalProducer
from steprl.training.sources.stream import StreamSource
from steprl.types import EndReason, Group, Step, Task, Trajectory


def _tasks() -> StreamSource:
    return StreamSource(lambda: iter([Task(f"t{i}", "q", "calculator") for i in range(1000)]))


def _group(task: Task, index: int, versions: tuple[int, ...]) -> Group:
    step = Step((1,), tuple(range(len(versions))), (0.0,) * len(versions), (), 1.0, versions[0], {}, versions)
    return Group(task, (Trajectory(task.id, f"0-{index}", "calculator", (step,), 1.0, EndReason.ANSWERED),))


class FakeProducer:
    """Finishes a group when the test says so, with the token versions the test gives."""

    def __init__(self) -> None:
        self.started: list[int] = []
        self.published: list[int] = []
        self._running: dict[int, tuple[Task, Any]] = {}

    def start(self, items: Any, done: Any) -> None:
        for index, task in items:
            self.started.append(index)
            self._running[index] = (task, done)

    def finish(self, index: int, versions: tuple[int, ...]) -> None:
        task, done = self._running.pop(index)
        done(index, _group(task, index, versions))

    def publish(self, weights: Any, version: int) -> None:
        self.published.append(version)

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run(coro)

    def close(self) -> None:
        pass


def _take_later(pipe: Pipeline, n: int) -> tuple[threading.Thread, list[list[Group]]]:
    out: list[list[Group]] = []
    t = threading.Thread(target=lambda: out.append(pipe.take(n)), daemon=True)
    t.start()
    time.sleep(0.05)
    return t, out


def test_staleness_0_admits_a_step_only_when_the_learner_asks():
    prod = FakeProducer()
    pipe = Pipeline(_tasks(), prod, tasks_per_step=2, max_staleness=0, version=0)
    assert prod.started == []  # nothing runs before the first take
    t, out = _take_later(pipe, 2)
    assert prod.started == [0, 1]
    prod.finish(1, (0,))
    prod.finish(0, (0,))
    t.join(2)
    assert [g.task.id for g in out[0]] == ["t0", "t1"]  # stream order, whatever finished first
    pipe.publish({}, 1)
    assert prod.started == [0, 1]  # the learner trains: nothing new starts before it asks again
    t, out = _take_later(pipe, 2)
    assert prod.started == [0, 1, 2, 3]
    prod.finish(2, (1,))
    prod.finish(3, (1,))
    t.join(2)
    assert pipe.take_metrics(1)["staleness/traj_0"] == 1.0


def test_window_is_k_plus_1_steps_and_an_overtaken_group_is_evicted_requeued_and_trained_once():
    prod = FakeProducer()
    pipe = Pipeline(_tasks(), prod, tasks_per_step=2, max_staleness=1, version=0)
    t, out = _take_later(pipe, 2)
    assert prod.started == [0, 1, 2, 3]  # (k + 1) x tasks_per_step in flight
    prod.finish(1, (0,))
    prod.finish(2, (0,))
    t.join(2)
    assert [g.task.id for g in out[0]] == ["t1", "t2"]
    assert pipe.take_metrics(2)["staleness/traj_0"] == 1.0
    pipe.publish({}, 1)
    t, out = _take_later(pipe, 2)
    assert prod.started == [0, 1, 2, 3, 4, 5]
    prod.finish(3, (0, 1))
    prod.finish(4, (1,))
    t.join(2)
    m = pipe.take_metrics(2)
    assert m["staleness/traj_1"] == 0.5 and m["staleness/token_1"] == pytest.approx(1 / 3)
    assert m["async/versions_spanned_max"] == 2.0 and m["staleness/optimizer_steps_max"] == 3.0
    pipe.publish({}, 2)
    # task 0 started at version 0 and came back only at version 2: trained now it would be
    # 2 > k stale. It is evicted and runs again at once (the window had room for 6 and 7).
    prod.finish(0, (0,))
    t, out = _take_later(pipe, 2)
    assert prod.started[6:] == [6, 7, 0]
    prod.finish(0, (2,))
    prod.finish(5, (1, 2))
    t.join(2)
    assert [g.task.id for g in out[0]] == ["t0", "t5"]
    assert pipe.take_metrics(1)["async/evicted_groups"] == 1.0
    trained = ["t1", "t2", "t3", "t4", "t0", "t5"]
    assert len(set(trained)) == len(trained)


def test_after_a_rollback_groups_of_the_undone_versions_run_again_whatever_the_staleness_bound():
    prod = FakeProducer()
    pipe = Pipeline(_tasks(), prod, tasks_per_step=2, max_staleness=2, version=0)
    t, out = _take_later(pipe, 2)
    prod.finish(0, (0,))
    prod.finish(1, (0,))
    t.join(2)
    pipe.publish({}, 1)  # step 1 trained: its version 1 is the one a health rule undoes
    prod.finish(2, (1,))  # sampled by version 1, within max_staleness of any later version
    prod.finish(3, (0,))  # version 0's weights are restored, but as version 2: this ran before
    pipe.roll_back({}, 2)  # the weights of step 0, as version 2
    t, out = _take_later(pipe, 2)
    assert prod.started.count(2) == 2 and prod.started.count(3) == 2  # both run again
    prod.finish(2, (2,))
    prod.finish(3, (2,))
    t.join(2)
    assert [g.task.id for g in out[0]] == ["t2", "t3"] and prod.published == [1, 2]
    assert pipe.take_metrics(1)["async/evicted_groups"] == 2.0


def test_pending_holds_in_flight_and_queued_work_and_a_new_pipeline_reissues_it_first():
    prod = FakeProducer()
    pipe = Pipeline(_tasks(), prod, tasks_per_step=2, max_staleness=2, version=0)
    t, _ = _take_later(pipe, 2)
    for i in (0, 1, 4):
        prod.finish(i, (0,))
    t.join(2)
    pending = pipe.pending()
    assert [i for i, _ in pending] == [2, 3, 4, 5]  # 4 queued, the others in flight
    assert pipe.depth() == (1, 3)
    source = _tasks()
    source.load_state_dict(pipe.tasks.state_dict())  # as a checkpoint restores it
    prod2 = FakeProducer()
    resumed = Pipeline(source, prod2, tasks_per_step=2, max_staleness=2, version=1, pending=pending)
    _take_later(resumed, 2)
    assert prod2.started == [2, 3, 4, 5, 6, 7]


def test_staleness_metrics_by_hand():
    task = Task("t", "q", "calculator")
    taken = [(Finished(0, _group(task, 0, (3, 3, 4)), 3), 5), (Finished(1, _group(task, 1, (5,)), 5), 5)]
    m = staleness_metrics(taken, max_staleness=2, optimizer_steps=2)
    assert m["staleness/traj_2"] == 0.5 and m["staleness/traj_0"] == 0.5  # 5-3, 5-5
    assert m["staleness/token_2"] == 0.5 and m["staleness/token_1"] == 0.25  # [2, 2, 1, 0]
    assert m["staleness/token_mean"] == pytest.approx(5 / 4)
    assert m["async/versions_spanned_mean"] == 1.5 and m["staleness/optimizer_steps_max"] == 5.0


def _setup(model, tokenizer, budgets):
    from steprl.engines.hf import HFEngine
    from steprl.envs.registry import make_env
    from steprl.rollout.chat import PlainFormat
    from steprl.rollout.context import AppendOnly
    from steprl.rollout.loop import RolloutSetup

    engine = HFEngine(
        copy.deepcopy(model), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    return RolloutSetup(
        lambda t: make_env("calculator"),
        engine,
        PlainFormat(tokenizer),
        AppendOnly(),
        SamplingParams(),
        budgets,
    )


def _calc_tasks() -> StreamSource:
    from steprl.envs.registry import make_tasks

    return StreamSource(lambda: make_tasks("calculator", "train", 0))


def test_local_producer_at_staleness_0_gives_the_synchronous_rollouts(small_model, tokenizer):
    """The same tasks through the pipeline's producer thread and through `asyncio.run`:
    identical trajectories (tokens, log-probs to the bit, versions)."""
    sync_setup = _setup(small_model, tokenizer, Budgets(3, 16, 256))
    sync = SyncSource(_calc_tasks(), local_rollout(sync_setup, 0), 4).take(3)
    s = _setup(small_model, tokenizer, Budgets(3, 16, 256))
    prod = LocalProducer(s, s.engine, group_size=4, seed=0)  # type: ignore[arg-type]
    try:
        piped = Pipeline(_calc_tasks(), prod, tasks_per_step=3, max_staleness=0, version=0).take(3)
    finally:
        prod.close()
    assert piped == sync
    assert sum(len(t.steps) for g in sync for t in g.trajectories) > 12


def test_weights_published_mid_generation_land_between_decode_steps(small_model, tokenizer):
    """A partial rollout: the tokens before the update are those of version 0 alone (same
    seeds), the rest are sampled by version 1, and every token says which."""
    budgets = Budgets(1, 120, 512)
    s0 = _setup(small_model, tokenizer, budgets)
    # both tasks of the window (max_staleness 1 admits 2): the group the learner gets first is
    # whichever finishes first, and new weights mid-way change the lengths, so match by task
    alone_by_task = {g.task.id: g for g in SyncSource(_calc_tasks(), local_rollout(s0, 0), 4).take(2)}
    s = _setup(small_model, tokenizer, budgets)
    engine = s.engine
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in small_model.state_dict().items()}
    prod = LocalProducer(s, engine, group_size=4, seed=0)  # type: ignore[arg-type]
    try:
        pipe = Pipeline(_calc_tasks(), prod, tasks_per_step=1, max_staleness=1, version=0)
        t, out = _take_later(pipe, 1)
        while engine.forward_passes < 15:
            time.sleep(0.001)
        pipe.publish(new, 1)
        t.join(30)
    finally:
        prod.close()
    spanned = 0
    alone = alone_by_task[out[0][0].task.id]
    for traj, ref in zip(out[0][0].trajectories, alone.trajectories, strict=True):
        step, ref_step = traj.steps[0], ref.steps[0]
        versions = step.token_versions
        assert list(versions) == sorted(versions) and set(versions) <= {0, 1}
        switch = versions.index(1) if 1 in versions else len(versions)
        assert step.action_ids[:switch] == ref_step.action_ids[:switch]
        # (the rows batch differently once the weights change: float rounding only)
        assert step.action_logprobs[:switch] == pytest.approx(ref_step.action_logprobs[:switch], abs=1e-5)
        spanned += 0 < switch < len(versions)
    assert spanned >= 1  # at least one turn was sampled by both versions

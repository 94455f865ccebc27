"""Horizon curricula (issue 26): every episode records the turn cap it ran under and whether the
cap cut it; the cap is fixed when a task is admitted (a group admitted ahead keeps its own);
`rollout.cap_truncation=mask` keeps a cut episode in its group's baseline but trains none of its
rows; the two schedules move as specified."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from steprl.algorithms import ADVANTAGES
from steprl.config import AlgorithmSection, load_config
from steprl.engines.base import SamplingParams
from steprl.engines.scripted import ScriptedEngine
from steprl.envs.registry import make_env, make_tasks
from steprl.rollout.chat import PlainFormat
from steprl.rollout.context import AppendOnly
from steprl.rollout.loop import Budgets, run_episode
from steprl.rollout.views import packed_view
from steprl.training.controllers import Controllers, StepReport
from steprl.training.loop.pipeline import Pipeline
from steprl.training.loop.step_batch import make_batch
from steprl.training.sources.stream import StreamSource
from steprl.types import EndReason, Group, Step, Task, Trajectory


def _corridor(k: int) -> Task:
    return next(t for t in make_tasks("corridor", "train", 0, k_min=k, k_max=k))


def _walk(tokenizer: Any, task: Task, cap: int) -> Trajectory:
    keys = ["L" if x > y else "R" for x, y in task.params["rooms"]]
    encode = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    engine = ScriptedEngine([f"<answer>{k}</answer>" for k in keys], encode)
    return asyncio.run(
        run_episode(
            make_env("corridor"),
            task,
            engine=engine,
            fmt=PlainFormat(tokenizer),
            rule=AppendOnly(),
            sampling=SamplingParams(),
            budgets=Budgets(cap, 24, 512),
            group_id="g",
            seed=0,
        )
    )


def test_every_episode_records_its_cap_and_whether_it_cut_it(tokenizer):
    task = _corridor(3)
    cut, solved = _walk(tokenizer, task, 2), _walk(tokenizer, task, 3)
    assert (cut.end, cut.outcome_reward, dict(cut.info)) == (
        EndReason.TRUNCATED,
        0.0,
        {"turn_cap": 2, "cut_by_cap": True},
    )
    assert solved.end is EndReason.ANSWERED and solved.outcome_reward == 1.0
    assert dict(solved.info) == {"turn_cap": 3, "cut_by_cap": False}


class _Producer:
    """Records the cap each admitted task was started with; finishes them on demand."""

    def __init__(self) -> None:
        self.caps: dict[int, int | None] = {}
        self.running: dict[int, tuple[Task, Any, int | None]] = {}

    def start(self, items: Any, done: Any, *, max_turns: int | None = None) -> None:
        for index, task in items:
            self.caps[index] = max_turns
            self.running[index] = (task, done, max_turns)

    def finish(self) -> None:
        for index, (task, done, cap) in sorted(self.running.items()):
            step = Step((1,), (2,), (0.0,), (), 0.0, 0)
            info = {"turn_cap": cap, "cut_by_cap": True}
            done(
                index,
                Group(task, (Trajectory(task.id, str(index), "e", (step,), 0.0, EndReason.TRUNCATED, info),)),
            )
        self.running.clear()

    def publish(self, weights: Any, version: int) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_group_admitted_ahead_keeps_the_cap_it_was_admitted_with():
    prod = _Producer()
    tasks = StreamSource(lambda: iter([Task(f"t{i}", "q", "e") for i in range(10)]))
    pipe = Pipeline(tasks, prod, tasks_per_step=1, max_staleness=1, version=0)  # type: ignore[arg-type]
    pipe.max_turns = 2
    prod.finish()  # nothing admitted yet
    pipe._top_up()  # the window: tasks 0 and 1, both at cap 2
    prod.finish()
    assert [g.task.id for g in pipe.take(1)] == ["t0"]
    pipe.take_metrics(1)
    pipe.max_turns = 4  # the curriculum moves on: task 1 ran ahead under 2, task 2 starts under 4
    first = pipe.take(1)
    assert prod.caps == {0: 2, 1: 2, 2: 4} and first[0].trajectories[0].info["turn_cap"] == 2
    # the metrics at the current cap (4) leave the stale group out: no evidence for the gate
    m = pipe.take_metrics(1)
    assert m["curriculum/episodes_at_cap"] == 0.0 and m["curriculum/max_turns"] == 4.0


def test_mask_keeps_a_cut_episode_in_the_baseline_and_trains_none_of_its_rows():
    """One group of 3 (rewards 1, 0 cut by the cap, 0 answered): the cut one's rows go, the
    others' advantages are those of the whole group (mean 1/3), not of the two left."""

    def traj(reward: float, cut: bool) -> Trajectory:
        step = Step((5, 6), (7, 8), (0.0, 0.0), (), reward, 0)
        end = EndReason.TRUNCATED if cut else EndReason.ANSWERED
        return Trajectory("t", "g", "e", (step,), reward, end, {"turn_cap": 1, "cut_by_cap": cut})

    group = Group(Task("t", "q", "e"), (traj(1.0, False), traj(0.0, True), traj(0.0, False)))
    algo = AlgorithmSection(advantage_params={"scale_by_std": False})
    parts = SimpleNamespace(
        to_samples=lambda t, i: [packed_view(t, i)],
        critic=None,
        ref_model=None,
        learner=None,
        policy=SimpleNamespace(tokenizer=SimpleNamespace(pad_token_id=0)),
        advantage_fn=lambda x: ADVANTAGES["grpo"](x, scale_by_std=False),
        step_credit=None,
    )
    batches = {
        mask: make_batch([group], parts, algo, env_ids={}, mask_cut=mask)  # type: ignore[arg-type]
        for mask in (False, True)
    }
    assert [r.view.traj_index for r in batches[False].rows] == [0, 1, 2]
    assert [r.view.traj_index for r in batches[True].rows] == [0, 2]
    kept = {r.view.traj_index: r.advantages for r in batches[True].rows}
    # the baseline counted the cut one: 1 - 1/3 and 0 - 1/3 (of the two left: +-1/2)
    assert max(kept[0]) == pytest.approx(2 / 3) and min(kept[2]) == pytest.approx(-1 / 3)
    assert batches[True].metrics["curriculum/masked_trajectories"] == 1.0


def _caps(cfg_extra: list[str], metrics: list[dict[str, float]]) -> list[int | None]:
    controllers = Controllers.for_config(load_config(None, cfg_extra))
    caps = [controllers.current().max_turns]
    for step, m in enumerate(metrics, start=1):
        caps.append(controllers.observe(StepReport(step, m)).max_turns)
    return caps


def test_stepwise_follows_agentgym_rl_and_gated_waits_for_both_thresholds():
    rounds = "trainer.curriculum.rounds=[2,4,6]"
    assert _caps([rounds, "trainer.curriculum.stage_steps=2"], [{}] * 6) == [2, 2, 4, 4, 6, 6, 6]
    ok = {
        "curriculum/episodes_at_cap": 8.0,
        "curriculum/success_at_cap": 0.9,
        "curriculum/cut_by_cap_frac": 0.1,
    }
    cut = ok | {"curriculum/cut_by_cap_frac": 0.5}
    gated = [rounds, "trainer.curriculum.horizon=gated", "trainer.curriculum.patience=2"]
    # a cut share over the bound resets the streak; a step with nothing at the cap holds it
    assert _caps(gated, [ok, cut, ok, {}, ok, ok, ok, ok]) == [2, 2, 2, 2, 2, 4, 4, 6, 6]

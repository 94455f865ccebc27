"""The advantages saved with a step's episodes are the ones each action token was trained with,
for both training layouts (a packed row per trajectory, a row per turn); an episode the step did
not train on saves none."""

from __future__ import annotations

import pytest
import torch

from steprl.rollout.views import Sample, packed_view, per_step_view, targets
from steprl.training.loop.saved_advantages import saved_advantages
from steprl.training.loop.step_batch import Row, StepBatch
from steprl.types import EndReason, Step, Trajectory

OFF_MASK = -99.0  # never a saved value: no estimator puts weight off the mask, this test does


def _episode(task: str, end: EndReason = EndReason.ANSWERED) -> Trajectory:
    """Three turns of an append-only context (each prompt extends the previous one), actions of
    different lengths, a final observation (the packed view drops it)."""
    prompt: tuple[int, ...] = (1, 2, 3)
    steps = []
    for turn, (action, obs) in enumerate((((10, 11), (20,)), ((12, 13, 14), (21, 22)), ((15,), (23,)))):
        steps.append(Step(prompt, action, (-0.5,) * len(action), obs, float(turn), 0))
        prompt = prompt + action + obs
    return Trajectory(task, "g", "calc", tuple(steps), 1.0, end)


def _row(view: Sample, turn_value: dict[int, float]) -> Row:
    """A row whose target-aligned advantage is its turn's value on the mask, OFF_MASK elsewhere:
    an off-by-one alignment would save an OFF_MASK or a neighbouring turn's value."""
    adv = tuple(
        turn_value[step] if mask else OFF_MASK
        for mask, step in zip(targets(view.loss_mask), targets(view.token_step), strict=True)
    )
    return Row(view, adv, adv, None)


@pytest.mark.parametrize("layout", ["packed", "per_step"])
def test_each_action_token_gets_its_rows_advantage(layout):
    trained, twin, failed = _episode("a"), _episode("a"), _episode("b", EndReason.INFRA_FAILED)
    assert trained == twin  # equal content: matched by identity, not by value
    if layout == "packed":  # one row per trajectory: each turn's tokens carry their turn's value
        rows = [_row(packed_view(trained, 0), {0: 0.25, 1: -1.5, 2: 3.0})]
        want = [[0.25] * 2, [-1.5] * 3, [3.0]]
    else:  # one row per turn, each with its own value
        rows = [_row(v, {k: 0.5 * (k + 1)}) for k, v in enumerate(per_step_view(trained, 0))]
        want = [[0.5] * 2, [1.0] * 3, [1.5]]
    batch = StepBatch((trained,), tuple(rows), torch.zeros(1), {})
    saved = saved_advantages([twin, trained, failed], batch)
    assert saved == [None, want, None]
    assert [len(turn) for turn in saved[1]] == [len(s.action_ids) for s in trained.steps]


def test_a_view_that_misses_an_action_token_is_refused():
    traj = _episode("a")
    short = per_step_view(traj, 0)[:2]  # the last turn's row is missing
    batch = StepBatch((traj,), tuple(_row(v, {k: 1.0}) for k, v in enumerate(short)), torch.zeros(1), {})
    with pytest.raises(ValueError, match=r"\[2, 3, 0\] advantages per turn for \[2, 3, 1\]"):
        saved_advantages([traj], batch)

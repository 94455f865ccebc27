"""The advantages a step trained each action token with, per trajectory, as the trajectory file
saves them (`diagnostics/sinks.TrajectoryWriter`, column `advantages`): per turn, per action
token, in the order of `Step.action_ids`.

Read back from the step's rows (`training/loop/step_batch.StepBatch.rows`), not recomputed: a row's
advantages are target-aligned, its loss mask and step ids input-aligned (`rollout/views.py`), so
`inputs` puts them side by side, and the loss-mask positions of a row are exactly its action
tokens, in order, each tagged with its turn (`Sample.token_step`). That holds for both layouts:
a packed row (one per trajectory, every turn) and per-step rows (one per turn).
"""

from __future__ import annotations

from collections.abc import Sequence

from steprl.rollout.views import inputs
from steprl.training.loop.step_batch import StepBatch
from steprl.types import Trajectory

#: per turn, per action token
Advantages = list[list[float]]


def saved_advantages(trajectories: Sequence[Trajectory], batch: StepBatch) -> list[Advantages | None]:
    """Parallel to `trajectories` (everything the step rolled out): each one's advantages per
    turn and action token, or None for one the step did not train on (its group filtered out,
    failed in the env, dropped by the LOOP |A| filter). A trajectory is matched to the batch by
    identity: `StepBatch.trajectories` holds the very objects rolled out, and each row's
    `traj_index` indexes it."""
    trained: dict[int, Advantages] = {}
    for row in batch.rows:
        traj = batch.trajectories[row.view.traj_index]
        turns = trained.setdefault(id(traj), [[] for _ in traj.steps])
        per_input = inputs(row.advantages)
        for mask, turn, adv in zip(row.view.loss_mask, row.view.token_step, per_input, strict=True):
            if mask:
                turns[turn].append(adv)
    for traj in batch.trajectories:
        if id(traj) not in trained:
            continue
        lengths = [len(t) for t in trained[id(traj)]]
        expected = [len(s.action_ids) for s in traj.steps]
        if lengths != expected:  # a view that dropped or repeated an action token: a bug here
            raise ValueError(
                f"trajectory {traj.task_id}: {lengths} advantages per turn for {expected} action "
                "tokens; the training views must cover every action token once"
            )
    return [trained.get(id(t)) for t in trajectories]


def saved_step_credit(
    trajectories: Sequence[Trajectory], batch: StepBatch
) -> list[list[float] | None] | None:
    """Parallel to `trajectories`: each one's learned step rewards (`algorithm.step_reward`), one
    per turn, as the model scored them before the update (column `step_credit`); None for one the
    step did not score (not in a kept group, failed in the env), and None for all without a model."""
    if batch.credit is None:
        return None
    data, scored = batch.credit
    per = dict(zip(map(id, data.trajectories), scored.per_trajectory(data.x), strict=True))
    return [per.get(id(t)) for t in trajectories]


__all__ = ["Advantages", "saved_advantages", "saved_step_credit"]

"""The two training views of a trajectory, built from its exact token ids.

* `packed_view` (append-only context): ONE sequence `prompt_0 + a_0 + o_0 + a_1 + ...` with a
  loss mask that is 1 exactly on action tokens. Observation and prompt tokens never carry weight.
* `per_step_view` (any other context rule): one sample per step, `prompt_t + a_t`, masked the same
  way, because later prompts no longer extend earlier ones.
* `training_view` (append-only context): the packed view, or per step for a harness env's
  episode that branched (`gateway/harness_runner.py`).

One alignment: every per-token tuple of a `Sample` is INPUT-aligned (entry t is about
`input_ids[t]`), because that is how the views are read and checked. What the model computes is
TARGET-aligned (entry t is about the prediction of `input_ids[t + 1]`, length `len(input_ids) - 1`):
log-probs, entropies, critic values, advantages, returns and the learner's `(B, T-1)` tensors.
`targets` (and its inverse `inputs`) converts a row; `training/learn/batching.collate` does the same to
a padded batch (its targets are `input_ids[:, 1:]`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from steprl.rollout.context import ContextRule
from steprl.types import Trajectory

T = TypeVar("T")


def targets(per_token: Sequence[T]) -> tuple[T, ...]:
    """An input-aligned per-token tuple of a `Sample`, target-aligned: entry 0 is dropped, since
    nothing predicts the first token (a loss mask, behaviour log-probs or step ids as the learner
    and the estimators read them)."""
    return tuple(per_token[1:])


def inputs(per_target: Sequence[float]) -> tuple[float, ...]:
    """The inverse of `targets` for values: a target-aligned row, input-aligned, with 0.0 for the
    first token (which carries no weight: the loss mask is 0 there)."""
    return (0.0, *per_target)


@dataclass(frozen=True)
class Sample:
    """One training row. All tuples are input-aligned: the same length as `input_ids`.

    `loss_mask[t] == 1` iff `input_ids[t]` was sampled by the policy; `old_logprobs[t]` is the
    engine's log-prob of that token (0.0 where the mask is 0).
    """

    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    old_logprobs: tuple[float, ...]
    traj_index: int  # which trajectory of the batch this row came from (for its advantage)
    #: step number (within the trajectory) of each action token; -1 on prompt/observation tokens
    token_step: tuple[int, ...] = ()
    #: per-token advantages and critic targets (0 off the mask); a view has none: the step's
    #: frozen `training/loop/step_batch.Row` holds them and makes the row the learner trains on
    advantages: tuple[float, ...] = ()
    returns: tuple[float, ...] = ()


def packed_view(traj: Trajectory, traj_index: int) -> Sample:
    """One sequence per trajectory; valid only when every prompt extends the previous context."""
    if not traj.steps:
        raise ValueError("cannot build a training view of a trajectory with no steps")
    ids = list(traj.steps[0].prompt_ids)
    mask = [0] * len(ids)
    old = [0.0] * len(ids)
    step_of = [-1] * len(ids)
    for i, s in enumerate(traj.steps):
        if tuple(ids) != s.prompt_ids:
            raise ValueError(
                f"step {i} of trajectory {traj.task_id} does not extend the previous context; "
                "packed_view needs context.rule=append_only (use per_step_view for other rules)."
            )
        ids += s.action_ids
        mask += [1] * len(s.action_ids)
        old += s.action_logprobs
        step_of += [i] * len(s.action_ids)
        ids += s.observation_ids
        mask += [0] * len(s.observation_ids)
        old += [0.0] * len(s.observation_ids)
        step_of += [-1] * len(s.observation_ids)
    # the final observation (if any) is context for nothing: drop it to save compute
    tail = len(traj.steps[-1].observation_ids)
    if tail:
        ids, mask, old, step_of = ids[:-tail], mask[:-tail], old[:-tail], step_of[:-tail]
    return Sample(tuple(ids), tuple(mask), tuple(old), traj_index, tuple(step_of))


def per_step_view(traj: Trajectory, traj_index: int) -> list[Sample]:
    """One row per step: the step's own prompt plus its action."""
    out = []
    for i, s in enumerate(traj.steps):
        n_prompt = len(s.prompt_ids)
        out.append(
            Sample(
                input_ids=s.prompt_ids + s.action_ids,
                loss_mask=(0,) * n_prompt + (1,) * len(s.action_ids),
                old_logprobs=(0.0,) * n_prompt + s.action_logprobs,
                traj_index=traj_index,
                token_step=(-1,) * n_prompt + (i,) * len(s.action_ids),
            )
        )
    return out


def extends_throughout(traj: Trajectory) -> bool:
    """Whether every step's prompt is exactly the context before it (what `packed_view` needs)."""
    ids: tuple[int, ...] = ()
    for i, s in enumerate(traj.steps):
        if i and s.prompt_ids != ids:
            return False
        ids = s.prompt_ids + s.action_ids + s.observation_ids
    return bool(traj.steps)


def training_view(traj: Trajectory, traj_index: int) -> list[Sample]:
    """The rows of an append-only run: one packed row, or, for a harness's episode whose prompt
    does not extend the context before it (it re-serialised its history: a branch), one per
    step. The agent loop's episodes always extend: one that does not is a bug, and
    `packed_view` says so."""
    branched = "gateway_calls" in traj.info and not extends_throughout(traj)
    return per_step_view(traj, traj_index) if branched else [packed_view(traj, traj_index)]


def check_context_rule(rule: ContextRule, trajectories: Sequence[Trajectory]) -> int:
    """What every context rule must give the learner: each trained token sits after exactly the
    prompt the engine was shown for it (`Step.prompt_ids`), with the engine's log-prob, in the
    rows the run trains (`training_view` for an append-only rule, one row per step otherwise);
    an append-only rule's prompts extend the context throughout. Returns the rows checked."""
    rows = 0
    for k, traj in enumerate(trajectories):
        if rule.append_only:
            assert extends_throughout(traj), f"trajectory {k}: an append-only rule's prompt did not extend"
        views = training_view(traj, k) if rule.append_only else per_step_view(traj, k)
        for row in views:
            rows += 1
            for i, step in enumerate(traj.steps):
                at = [t for t, s in enumerate(row.token_step) if s == i]
                if not at:
                    continue
                start = at[0]
                assert row.input_ids[:start] == step.prompt_ids, (
                    f"trajectory {k} step {i}: trained after another prompt"
                )
                assert row.input_ids[start : start + len(at)] == step.action_ids, (
                    f"trajectory {k} step {i}: action"
                )
                assert all(row.loss_mask[t] for t in at), (
                    f"trajectory {k} step {i}: action tokens off the mask"
                )
                assert tuple(row.old_logprobs[t] for t in at) == step.action_logprobs, f"step {i}: log-probs"
            trained = sum(row.loss_mask)
            assert trained == sum(1 for s in row.token_step if s >= 0), "a masked token of no step"
    return rows

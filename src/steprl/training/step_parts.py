"""The pieces of one RL step that the trainer composes: filtered group collection and the
advantage pass. Each is algorithm-blind: the functions it calls are looked up by name."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from steprl.algorithms import estimators, filters, losses
from steprl.algorithms.inputs import AdvantageInputs, AdvantageOutput
from steprl.config import AlgorithmSection
from steprl.rollout.loop import RolloutSetup, rollout_groups
from steprl.rollout.views import Sample
from steprl.training.sources import TaskSource, take
from steprl.types import Group, Task, Trajectory

#: (tasks, group_size, first_index) -> one Group per task; `first_index` is the stream position
#: of `tasks[0]`, which keys the episode seeds (`rollout/seeds.py`).
RolloutFn = Callable[[Sequence[Task], int, int], list[Group]]


class GroupSource(Protocol):
    """Where a step's groups come from: the trainer's `pipeline.Pipeline`, or `SyncSource`."""

    def take(self, n: int) -> list[Group]:
        """`n` finished groups (fewer only if the task stream ran out), in stream order."""
        ...


def local_rollout(setup: RolloutSetup, seed: int) -> RolloutFn:
    """Run the agent loop in this process on one asyncio loop per call."""

    def run(tasks: Sequence[Task], group_size: int, first_index: int) -> list[Group]:
        return asyncio.run(rollout_groups(tasks, group_size, setup, seed=seed, first_index=first_index))

    return run


@dataclass
class SyncSource:
    """The next `n` tasks of the stream, rolled out by `rollout` while the caller waits: the
    plainest source (tests, and the reference the pipeline at staleness 0 is checked against)."""

    tasks: TaskSource  # never re-queued to: the positions of `n` tasks are consecutive
    rollout: RolloutFn
    group_size: int

    def take(self, n: int) -> list[Group]:
        items = take(self.tasks, n)
        if not items:
            return []
        groups = self.rollout([t for _, t in items], self.group_size, items[0][0])
        for group in groups:
            self.tasks.observe(group)
        return groups


def valid(t: Trajectory) -> bool:
    """Trainable: ended by the policy or the env (not the infrastructure), with at least one
    step, and finite rewards (NUM-03: a NaN or Inf reward invalidates the trajectory)."""
    return (
        t.trainable
        and bool(t.steps)
        and math.isfinite(t.outcome_reward)
        and all(math.isfinite(s.reward) for s in t.steps)
    )


@dataclass(frozen=True)
class CollectedGroups:
    rollouts: list[Trajectory]  # everything rolled out this step (for in == out accounting)
    kept: list[Group]  # groups that passed the filter (at most tasks_per_step)
    metrics: dict[str, float]


def collect_groups(
    source: GroupSource,
    *,
    tasks_per_step: int,
    group_filter: Callable[..., torch.Tensor],
    regenerations: int,
    failure_budget: float = 1.0,
) -> CollectedGroups:
    """Roll out `tasks_per_step` groups, filter them, and (DAPO dynamic sampling) roll out more
    tasks up to `regenerations` times while fewer than `tasks_per_step` groups survive.

    Failure budget (reliability §2.2): when more than `failure_budget` of a round's trajectories
    are infra failures (`infra_failed` / `env_timeout`), none of that round's groups are kept: a
    batch that is mostly a broken environment is not a sample of the policy. An empty result is
    possible: the trainer then skips the update and raises an alert."""
    rollouts: list[Trajectory] = []
    kept: list[Group] = []
    groups_in = 0
    rounds = 0
    over_budget = 0
    while True:
        groups = source.take(tasks_per_step)
        round_trajs = [t for g in groups for t in g.trajectories]
        rollouts += round_trajs
        groups_in += len(groups)
        failed = sum(not t.trainable for t in round_trajs)
        if round_trajs and failed / len(round_trajs) > failure_budget:
            over_budget += 1
            groups = []
        trainable = [Group(g.task, tuple(t for t in g.trajectories if valid(t))) for g in groups]
        trainable = [g for g in trainable if g.trajectories]
        rewards = [torch.tensor([t.outcome_reward for t in g.trajectories]) for g in trainable]
        keep = group_filter(rewards).tolist() if rewards else []
        kept += [trainable[i] for i in sorted(keep)]
        rounds += 1
        if len(kept) >= tasks_per_step or rounds > regenerations:
            break
    kept = kept[:tasks_per_step]
    return CollectedGroups(
        rollouts,
        kept,
        {
            "filter/groups_in": float(groups_in),
            "filter/groups_kept": float(len(kept)),
            "filter/regenerations": float(rounds - 1),
            "filter/skipped_step": float(not kept),
            "infra/failed_frac": sum(not t.trainable for t in rollouts) / max(1, len(rollouts)),
            "invalid/nonfinite_reward": float(
                sum(t.trainable and bool(t.steps) and not valid(t) for t in rollouts)
            ),
            "infra/over_budget_rounds": float(over_budget),
        },
    )


def shaped_rewards(trajectories: Sequence[Trajectory], algo: AlgorithmSection) -> torch.Tensor:
    """Outcome rewards plus DAPO overlong shaping on the number of generated tokens, if configured."""
    rewards = torch.tensor([t.outcome_reward for t in trajectories], dtype=torch.float32)
    if algo.overlong:
        lengths = torch.tensor([t.num_action_tokens for t in trajectories])
        rewards = rewards + filters.overlong_shaping(
            lengths,
            max_len=int(algo.overlong["max_len"]),
            cache_len=int(algo.overlong["cache_len"]),
            penalty=float(algo.overlong.get("penalty", 1.0)),
        )
    return rewards


def postprocess(out: AdvantageOutput, inputs: AdvantageInputs, algo: AlgorithmSection) -> AdvantageOutput:
    """Optional modifiers after any estimator: AgentRL task normalisation, EMPG."""
    if algo.task_normalize:
        out = estimators.task_normalized(inputs, out)
    if algo.empg is not None:
        out = estimators.entropy_modulated(inputs, out, **algo.empg)
    return out


def trajectory_abs_advantage(out: AdvantageOutput, row_traj: torch.Tensor, num_traj: int) -> torch.Tensor:
    """(N,) the largest |A| over each trajectory's action tokens (LOOP's |A| filter reads it)."""
    per_row = out.advantages.abs().amax(dim=1) if out.advantages.numel() else torch.zeros(row_traj.numel())
    return torch.zeros(num_traj).scatter_reduce(0, row_traj, per_row, reduce="amax")


def with_kl_in_reward(
    inputs: AdvantageInputs,
    ref_logp: Sequence[torch.Tensor],
    samples: Sequence[Sample],
    *,
    beta: float,
    kind: str,
) -> tuple[AdvantageInputs, float]:
    """KL in the reward (verl `use_kl_in_reward`): every action token's reward gets
    `-beta * kl(behaviour, reference)`, and each trajectory's outcome reward the sum over its
    tokens, so token-level and outcome estimators both see the penalty.

    Also returns the observed KL as verl measures it for its controller: the mean over rows of
    each row's token-mean KL (`masked_mean(kl, mask, axis=-1).mean()`)."""
    ref = torch.zeros_like(inputs.mask)
    behav = torch.zeros_like(inputs.mask)
    for i, (r, s) in enumerate(zip(ref_logp, samples, strict=True)):
        ref[i, : r.numel()] = r
        behav[i, : len(s.old_logprobs) - 1] = torch.tensor(s.old_logprobs[1:])
    token_rewards = losses.kl_in_reward(inputs.token_rewards, behav, ref, inputs.mask, beta, kind)
    penalty = (token_rewards - inputs.token_rewards).sum(dim=1)
    rewards = inputs.rewards.index_add(0, inputs.row_traj, penalty)
    kl = losses.kl_penalty(behav, ref, kind) * inputs.mask
    observed = (kl.sum(dim=1) / inputs.mask.sum(dim=1).clamp(min=1)).mean()
    return replace(inputs, token_rewards=token_rewards, rewards=rewards), float(observed)

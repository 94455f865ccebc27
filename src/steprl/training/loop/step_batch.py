"""One step's batch, in the order the trainer builds it: `collect_groups` takes and filters the
step's groups, `make_batch` turns the kept ones into `StepBatch`, the one record of what is
trained. `make_batch` owns reward shaping, KL in the reward (its coefficient is the
controllers' current one, `training/controllers/`), the estimator named in the config,
post-processing (task normalisation, EMPG) and the LOOP |A| filter, so no parallel lists indexed
by trajectory are kept in step by hand anywhere else. Each piece is algorithm-blind: the
functions it calls are looked up by name.

Alignment (`rollout/views.py`): a `Sample`'s tuples are input-aligned; everything computed here
(`AdvantageInputs`, advantages, returns, critic values, entropies) is target-aligned, and the
views' `targets` / `inputs` are the only conversions.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from steprl.algorithms import estimators, filters, losses
from steprl.algorithms.inputs import AdvantageInputs, AdvantageOutput, step_ends
from steprl.config import AlgorithmSection
from steprl.rollout.views import Sample, inputs, targets
from steprl.training.learn.critic import collate_values
from steprl.training.learn.learner_protocol import Computed
from steprl.training.setup.build import Parts
from steprl.training.step_rewards import Scored, StepData
from steprl.types import Group, Trajectory

# -- the step's groups -------------------------------------------------------------------------


class GroupSource(Protocol):
    """Where a step's groups come from: the trainer's `pipeline.Pipeline` (tests also use a
    synchronous one, `tests/training/step_helpers.SyncSource`)."""

    def take(self, n: int) -> list[Group]:
        """`n` finished groups (fewer only if the task stream ran out), in stream order."""
        ...


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


# -- the batch ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One training row, built once per step: a trajectory view and what the step computed for
    it. The per-token tuples here are target-aligned (length `len(view.input_ids) - 1`)."""

    view: Sample  # ids, loss mask, behaviour log-probs, traj_index, as `rollout/views.py` made it
    advantages: tuple[float, ...]  # 0 off the mask
    returns: tuple[float, ...]  # the critic's targets (equal to the advantages without a critic)
    old_values: tuple[float, ...] | None  # the critic's values before this step (GAE/PPO)

    @property
    def sample(self) -> Sample:
        """The row as the learner and critic read it: the view with its advantages and returns."""
        return replace(self.view, advantages=inputs(self.advantages), returns=inputs(self.returns))


@dataclass(frozen=True)
class StepBatch:
    trajectories: tuple[Trajectory, ...]  # the trainable ones; `Sample.traj_index` indexes this
    rows: tuple[Row, ...]  # after the LOOP filter: exactly what the learner trains on
    abs_advantage: torch.Tensor  # (len(trajectories),) max |A| per trajectory (before the filter)
    metrics: dict[str, float]
    #: with a step-reward model: what it scored and fits on (`StepData`), and its scores
    credit: tuple[StepData, Scored] | None = None

    @functools.cached_property
    def samples(self) -> tuple[Sample, ...]:
        """The rows as the learner reads them: one object per step, so the learner's passes over
        it (cross-policy ratios, the proximal pass, every epoch) collate each row once."""
        return tuple(r.sample for r in self.rows)

    @property
    def old_values(self) -> list[tuple[float, ...]] | None:
        vals = [r.old_values for r in self.rows]
        return None if not vals or vals[0] is None else [v for v in vals if v is not None]

    @property
    def envs(self) -> tuple[str, ...]:
        """Each row's env (`task.env`): the learner's per-env gradient shares read it."""
        return tuple(self.trajectories[r.view.traj_index].env for r in self.rows)

    @property
    def policy_versions(self) -> tuple[int, ...]:
        """The versions that sampled the trained trajectories (all equal when synchronous)."""
        return tuple(sorted({s.policy_version for t in self.trajectories for s in t.steps}))


def make_batch(
    groups: Sequence[Group],
    parts: Parts,
    algo: AlgorithmSection,
    *,
    env_ids: dict[str, int],
    kl_coef: float | None = None,
    mask_cut: bool = False,
    step: int = 0,
) -> StepBatch:
    """`step`: the RL step this batch trains (the step-reward guard's lines name it).
    `kl_coef`: the step's KL coefficient in the reward (the levers'; None: algorithm.kl_coef).
    `mask_cut` (`rollout.cap_truncation=mask`): an episode the turn cap cut off keeps its reward
    in its group's baseline but its rows are dropped (no loss)."""
    trainable = tuple(t for g in groups for t in g.trajectories)
    views = [s for i, t in enumerate(trainable) for s in parts.to_samples(t, i)]
    if not views:
        return StepBatch(trainable, (), torch.zeros(0), {})
    critic = parts.critic
    old_values = critic.values(views) if critic else None
    kl_in_reward = parts.ref_model is not None and algo.kl_in == "reward"
    # one policy pass (EMPG's entropies) and one reference pass (the KL in the reward), if asked
    want = {"entropies": algo.empg is not None, "ref_logprobs": kl_in_reward}
    computed = parts.learner.compute(views, **want) if any(want.values()) else Computed()
    x = advantage_inputs(
        trainable,
        views,
        shaped_rewards(trainable, algo),
        env_ids=env_ids,
        values=old_values,
        entropy=[tuple(e.tolist()) for e in computed.entropies] if computed.entropies is not None else None,
    )
    metrics: dict[str, float] = {}
    if computed.ref_logprobs is not None:
        beta = algo.kl_coef if kl_coef is None else kl_coef
        x, reward_kl = with_kl_in_reward(x, computed.ref_logprobs, views, beta=beta, kind=algo.kl_kind)
        # the rows before the LOOP filter: verl's n_steps for the adaptive KL controller
        metrics = {
            "actor/reward_kl": reward_kl,
            "actor/reward_kl_coef": beta,
            "actor/reward_kl_rows": float(len(views)),
        }
    credit = None
    if parts.step_credit is not None:  # a learned step reward: into the rewards or the advantages
        data = StepData(x, tuple(views), trainable)
        scored = parts.step_credit.score(data, step)
        credit = (data, scored)
        x = scored.into_rewards(x)
        metrics |= scored.metrics
    out = parts.advantage_fn(x)
    if credit is not None:
        out = credit[1].into_advantages(x, out)
    out = postprocess(out, x, algo)
    abs_adv = trajectory_abs_advantage(out, x.row_traj, len(trainable))
    rows = []
    for i, v in enumerate(views):
        n = len(v.input_ids) - 1  # the row's targets; the rest of the batch's width is padding
        adv, ret = tuple(out.advantages[i, :n].tolist()), tuple(out.returns[i, :n].tolist())
        rows.append(Row(v, adv, ret, tuple(old_values[i]) if old_values is not None else None))
    if algo.min_abs_advantage > 0:  # LOOP: drop trajectories that carry no signal
        keep = set(filters.loop_abs_adv_keep(abs_adv, algo.min_abs_advantage).tolist())
        rows = [r for r in rows if r.view.traj_index in keep]
    if mask_cut:  # the advantages above saw its reward; only its own loss goes
        cut = {i for i, t in enumerate(trainable) if t.info.get("cut_by_cap")}
        rows = [r for r in rows if r.view.traj_index not in cut]
        metrics = {**metrics, "curriculum/masked_trajectories": float(len(cut))}
    return StepBatch(trainable, tuple(rows), abs_adv, metrics, credit)


# -- what make_batch calls, in its order -------------------------------------------------------


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


def anchor_key(traj: Trajectory, step: int) -> Hashable:
    """The state a step acted on: the env's anchor if it gives one, else the observation ids
    the step followed (the task prompt for step 0). Identical states hash identically (GiGPO)."""
    s = traj.steps[step]
    if "anchor" in s.info:
        return s.info["anchor"]
    return traj.steps[step - 1].observation_ids if step > 0 else s.prompt_ids


def advantage_inputs(
    trajectories: Sequence[Trajectory],
    views: Sequence[Sample],
    rewards: torch.Tensor,
    *,
    env_ids: dict[str, int],
    values: Sequence[Sequence[float]] | None = None,
    entropy: Sequence[Sequence[float]] | None = None,
) -> AdvantageInputs:
    """`views[i].traj_index` indexes `trajectories`; `rewards` (N,) are the shaped outcomes;
    `values` and `entropy` are target-aligned per row, like every token-level field built here."""
    groups = {gid: i for i, gid in enumerate(dict.fromkeys(t.group_id for t in trajectories))}
    offsets: list[int] = []
    step_traj: list[int] = []
    step_index: list[int] = []
    step_rewards: list[float] = []
    anchors: list[Hashable] = []
    for n, t in enumerate(trajectories):
        offsets.append(len(step_traj))
        for k, s in enumerate(t.steps):
            step_traj.append(n)
            step_index.append(k)
            step_rewards.append(s.reward)
            anchors.append(anchor_key(t, k))
    mask = _loss_masks(views)
    token_step = torch.full(mask.shape, -1, dtype=torch.long)
    for i, v in enumerate(views):
        local = torch.tensor(targets(v.token_step), dtype=torch.long)
        token_step[i, : local.numel()] = torch.where(local >= 0, local + offsets[v.traj_index], local)
    step_r = torch.tensor(step_rewards, dtype=torch.float32)
    ends = step_ends(token_step)
    token_rewards = torch.where(ends, torch.cat([step_r, torch.zeros(1)])[token_step.clamp(min=0)], 0.0)
    return AdvantageInputs(
        rewards=rewards.float(),
        group_index=torch.tensor([groups[t.group_id] for t in trajectories], dtype=torch.long),
        env_index=torch.tensor(
            [env_ids.setdefault(t.env, len(env_ids)) for t in trajectories], dtype=torch.long
        ),
        step_traj=torch.tensor(step_traj, dtype=torch.long),
        step_index=torch.tensor(step_index, dtype=torch.long),
        step_rewards=step_r,
        anchor_keys=tuple(anchors),
        mask=mask,
        token_step=token_step,
        row_traj=torch.tensor([v.traj_index for v in views], dtype=torch.long),
        token_rewards=token_rewards,
        values=collate_values(values, mask.shape) if values is not None else None,
        entropy=collate_values(entropy, mask.shape) if entropy is not None else None,
        user_error=user_errors(trajectories),
    )


def _loss_masks(views: Sequence[Sample]) -> torch.Tensor:
    """(B, T-1) the rows' target-aligned loss masks, right-padded with 0 (as the learner's batches)."""
    mask = torch.zeros(len(views), max(len(v.input_ids) for v in views) - 1)
    for i, v in enumerate(views):
        mask[i, : len(v.input_ids) - 1] = torch.tensor(targets(v.loss_mask), dtype=torch.float32)
    return mask


def user_errors(trajectories: Sequence[Trajectory]) -> torch.Tensor | None:
    """(N,) whether a step of each trajectory was the simulated user's error, or None if none was."""
    flags = [any(s.info.get("user_error") for s in t.steps) for t in trajectories]
    return torch.tensor(flags, dtype=torch.bool) if any(flags) else None


def with_kl_in_reward(
    x: AdvantageInputs,
    ref_logp: Sequence[torch.Tensor],
    views: Sequence[Sample],
    *,
    beta: float,
    kind: str,
) -> tuple[AdvantageInputs, float]:
    """KL in the reward (verl `use_kl_in_reward`): every action token's penalty
    `-beta * kl(behaviour, reference)` goes into the rewards of each level, so every estimator
    sees it at the level it reads:
    * token (`token_rewards`: REINFORCE++, GAE, bi-level GAE): on the token itself;
    * step (`step_rewards`: step GAE, GiGPO's step part): the sum over the step's action tokens;
    * trajectory (`rewards`: GRPO, RLOO, ..., GiGPO's episode part): the sum over its tokens.

    Also returns the observed KL as verl measures it for its controller: the mean over rows of
    each row's token-mean KL (`masked_mean(kl, mask, axis=-1).mean()`)."""
    ref = torch.zeros_like(x.mask)
    behav = torch.zeros_like(x.mask)
    for i, (r, v) in enumerate(zip(ref_logp, views, strict=True)):
        ref[i, : r.numel()] = r
        old = targets(v.old_logprobs)
        behav[i, : len(old)] = torch.tensor(old)
    token_rewards = losses.kl_in_reward(x.token_rewards, behav, ref, x.mask, beta, kind)
    per_token = token_rewards - x.token_rewards
    rewards = x.rewards.index_add(0, x.row_traj, per_token.sum(dim=1))
    on_step = x.token_step >= 0  # the penalty is 0 off the mask, so only action tokens matter
    step_rewards = x.step_rewards.index_add(0, x.token_step[on_step], per_token[on_step])
    kl = losses.kl_penalty(behav, ref, kind) * x.mask
    observed = (kl.sum(dim=1) / x.mask.sum(dim=1).clamp(min=1)).mean()
    penalised = replace(x, token_rewards=token_rewards, rewards=rewards, step_rewards=step_rewards)
    return penalised, float(observed)


def postprocess(out: AdvantageOutput, x: AdvantageInputs, algo: AlgorithmSection) -> AdvantageOutput:
    """Optional modifiers after any estimator: AgentRL task normalisation, EMPG."""
    if algo.task_normalize:
        out = estimators.task_normalized(x, out)
    if algo.empg is not None:
        out = estimators.entropy_modulated(x, out, **algo.empg)
    return out


def trajectory_abs_advantage(out: AdvantageOutput, row_traj: torch.Tensor, num_traj: int) -> torch.Tensor:
    """(N,) the largest |A| over each trajectory's action tokens (LOOP's |A| filter reads it)."""
    per_row = out.advantages.abs().amax(dim=1) if out.advantages.numel() else torch.zeros(row_traj.numel())
    return torch.zeros(num_traj).scatter_reduce(0, row_traj, per_row, reduce="amax")


__all__ = [
    "CollectedGroups",
    "GroupSource",
    "Row",
    "StepBatch",
    "advantage_inputs",
    "collect_groups",
    "make_batch",
    "valid",
    "with_kl_in_reward",
]

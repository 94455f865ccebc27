"""`make_batch`: from the kept groups of one step to `StepBatch`, the one record of what is
trained. It owns reward shaping, KL in the reward (its coefficient is the controllers'
current one, `training/controllers/`), the estimator named in the config, post-processing
(task normalisation, EMPG) and the LOOP |A| filter, so no parallel lists indexed by trajectory
are kept in step by hand anywhere else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from steprl.algorithms import filters
from steprl.config import AlgorithmSection
from steprl.rollout.views import Sample
from steprl.training.advantage_batch import attach, build_advantage_inputs
from steprl.training.build import Parts
from steprl.training.controllers import Adjustments
from steprl.training.step_parts import (
    postprocess,
    shaped_rewards,
    trajectory_abs_advantage,
    with_kl_in_reward,
)
from steprl.types import Group, Trajectory


@dataclass(frozen=True)
class Row:
    """One training row with everything the learner and critic read about it."""

    sample: Sample  # ids, loss mask, behaviour log-probs, advantages, returns, traj_index
    old_values: tuple[float, ...] | None  # the critic's values before this step (GAE/PPO)


@dataclass(frozen=True)
class StepBatch:
    trajectories: tuple[Trajectory, ...]  # the trainable ones; `Sample.traj_index` indexes this
    rows: tuple[Row, ...]  # after the LOOP filter: exactly what the learner trains on
    abs_advantage: torch.Tensor  # (len(trajectories),) max |A| per trajectory (before the filter)
    metrics: dict[str, float]

    @property
    def samples(self) -> list[Sample]:
        return [r.sample for r in self.rows]

    @property
    def old_values(self) -> list[tuple[float, ...]] | None:
        vals = [r.old_values for r in self.rows]
        return None if not vals or vals[0] is None else [v for v in vals if v is not None]

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
    settings: Adjustments,
) -> StepBatch:
    """`settings`: the controllers' current adjustments (the KL coefficient, when one sets it)."""
    trainable = tuple(t for g in groups for t in g.trajectories)
    samples = [s for i, t in enumerate(trainable) for s in parts.to_samples(t, i)]
    if not samples:
        return StepBatch(trainable, (), torch.zeros(0), {})
    learner, critic = parts.learner, parts.critic
    old_values = critic.values(samples) if critic else None
    inputs = build_advantage_inputs(
        trainable,
        samples,
        shaped_rewards(trainable, algo),
        pad_id=parts.policy.tokenizer.pad_token_id,
        env_ids=env_ids,
        values=old_values,
        entropy=learner.entropies_of(samples) if algo.empg is not None else None,
    )
    metrics: dict[str, float] = {}
    if parts.ref_model is not None and algo.kl_in == "reward":
        ref_logp = learner.logprobs_of(samples, parts.ref_model)
        beta = algo.kl_coef if settings.kl_coef is None else settings.kl_coef
        inputs, reward_kl = with_kl_in_reward(inputs, ref_logp, samples, beta=beta, kind=algo.kl_kind)
        # the rows before the LOOP filter: verl's n_steps for the adaptive KL controller
        metrics = {
            "actor/reward_kl": reward_kl,
            "actor/reward_kl_coef": beta,
            "actor/reward_kl_rows": float(len(samples)),
        }
    out = postprocess(parts.advantage_fn(inputs), inputs, algo)
    with_adv = attach(samples, out)
    abs_adv = trajectory_abs_advantage(out, inputs.row_traj, len(trainable))
    rows = [Row(s, tuple(old_values[i]) if old_values is not None else None) for i, s in enumerate(with_adv)]
    if algo.min_abs_advantage > 0:  # LOOP: drop trajectories that carry no signal
        keep = set(filters.loop_abs_adv_keep(abs_adv, algo.min_abs_advantage).tolist())
        rows = [r for r in rows if r.sample.traj_index in keep]
    return StepBatch(trainable, tuple(rows), abs_adv, metrics)


__all__ = ["Row", "StepBatch", "make_batch"]

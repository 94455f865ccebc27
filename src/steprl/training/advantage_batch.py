"""From trajectories and their training rows to `AdvantageInputs`, and advantages back onto rows."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import replace

import torch

from steprl.algorithms.inputs import AdvantageInputs, AdvantageOutput
from steprl.rollout.views import Sample
from steprl.training.batching import collate
from steprl.training.critic import collate_values
from steprl.types import Trajectory


def anchor_key(traj: Trajectory, step: int) -> Hashable:
    """The state a step acted on: the env's anchor if it gives one, else the observation ids
    the step followed (the task prompt for step 0). Identical states hash identically (GiGPO)."""
    s = traj.steps[step]
    if "anchor" in s.info:
        return s.info["anchor"]
    return traj.steps[step - 1].observation_ids if step > 0 else s.prompt_ids


def build_advantage_inputs(
    trajectories: Sequence[Trajectory],
    samples: Sequence[Sample],
    rewards: torch.Tensor,
    *,
    pad_id: int,
    env_ids: dict[str, int],
    values: Sequence[Sequence[float]] | None = None,
    entropy: Sequence[Sequence[float]] | None = None,
) -> AdvantageInputs:
    """`samples[i].traj_index` indexes `trajectories`; `rewards` (N,) are the shaped outcomes."""
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
    batch = collate(samples, pad_id)
    mask = batch.loss_mask
    token_step = torch.full(mask.shape, -1, dtype=torch.long)
    for i, smp in enumerate(samples):
        local = torch.tensor(smp.token_step[1:], dtype=torch.long)
        token_step[i, : local.numel()] = torch.where(local >= 0, local + offsets[smp.traj_index], local)
    step_r = torch.tensor(step_rewards, dtype=torch.float32)
    nxt = torch.cat([token_step[:, 1:], torch.full_like(token_step[:, :1], -1)], dim=1)
    is_end = (token_step >= 0) & (nxt != token_step)
    token_rewards = torch.where(is_end, torch.cat([step_r, torch.zeros(1)])[token_step.clamp(min=0)], 0.0)
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
        row_traj=torch.tensor([s.traj_index for s in samples], dtype=torch.long),
        token_rewards=token_rewards,
        values=collate_values(values, mask.shape) if values is not None else None,
        entropy=collate_values(entropy, mask.shape) if entropy is not None else None,
    )


def attach(samples: Sequence[Sample], out: AdvantageOutput) -> list[Sample]:
    """Copy each row's (target-aligned) advantages and returns into its Sample (input-aligned)."""
    rows = []
    for i, s in enumerate(samples):
        n = len(s.input_ids) - 1
        rows.append(
            replace(
                s,
                advantages=(0.0, *out.advantages[i, :n].tolist()),
                returns=(0.0, *out.returns[i, :n].tolist()),
            )
        )
    return rows

"""The records estimators and losses read: one batch of rollouts at three levels.

Trajectory level (N), step level (S: every step of every trajectory, flattened) and token level
(B rows x T positions, aligned with the learner's targets: position t scores token t+1). Each
estimator adapter reads only what it needs; the trainer builds this once per step.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class AdvantageInputs:
    # trajectory level
    rewards: Tensor  # (N,) outcome reward (after shaping)
    group_index: Tensor  # (N,) long: rollouts of one task share it
    env_index: Tensor  # (N,) long: which environment / task family
    # step level
    step_traj: Tensor  # (S,) long: trajectory of each step
    step_index: Tensor  # (S,) long: position of the step in its trajectory (0-based)
    step_rewards: Tensor  # (S,) per-step reward
    anchor_keys: tuple[Hashable, ...]  # (S,) the state each step acted on (GiGPO anchor)
    # token level (rows are packed trajectories or single steps)
    mask: Tensor  # (B, T) float: 1 on action tokens
    token_step: Tensor  # (B, T) long: global step id (index into S) of action tokens, -1 elsewhere
    row_traj: Tensor  # (B,) long: trajectory of each row
    token_rewards: Tensor  # (B, T) each step's reward on its last action token, 0 elsewhere
    values: Tensor | None = None  # (B, T) critic values V(prefix up to t), if a critic is trained
    entropy: Tensor | None = None  # (B, T) token entropy under the behaviour policy (EMPG)

    @property
    def step_values(self) -> Tensor | None:
        """(S,) the critic's value of the state each step starts from (its first action token)."""
        if self.values is None:
            return None
        return first_token_of_steps(self.values, self.token_step, self.step_traj.numel())

    @property
    def step_entropy(self) -> Tensor | None:
        """(S,) mean token entropy over each step's action tokens."""
        if self.entropy is None:
            return None
        s = self.step_traj.numel()
        valid = self.token_step >= 0
        ids = self.token_step[valid]
        sums = torch.zeros(s).index_add_(0, ids, self.entropy[valid].float())
        counts = torch.zeros(s).index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))
        return sums / counts.clamp(min=1)

    @property
    def step_end(self) -> Tensor:
        """(B, T) bool: the last action token of each step (where a step's reward sits)."""
        return step_ends(self.token_step)


def step_ends(token_step: Tensor) -> Tensor:
    """(B, T) bool: where a step's run of action tokens ends (the next position holds another
    step, or none): the token that carries the step's reward."""
    nxt = torch.cat([token_step[:, 1:], torch.full_like(token_step[:, :1], -1)], dim=1)
    return (token_step >= 0) & (nxt != token_step)


def first_token_of_steps(values: Tensor, token_step: Tensor, num_steps: int) -> Tensor:
    flat_steps = token_step.flatten()
    positions = torch.nonzero(flat_steps >= 0).flatten()
    first = torch.full((num_steps,), values.numel(), dtype=torch.long)
    first = first.scatter_reduce(0, flat_steps[positions], positions, reduce="amin")
    padded = torch.cat([values.flatten().float(), torch.zeros(1)])  # steps without tokens read 0
    return padded[first]


@dataclass(frozen=True)
class AdvantageOutput:
    advantages: Tensor  # (B, T), zero off the mask
    returns: Tensor  # (B, T) critic targets (equal to advantages for critic-free estimators)


@dataclass(frozen=True)
class PolicyLossInputs:
    """Per-token log-probs for one micro-batch, all (B, T)."""

    logp: Tensor  # current policy (with grad)
    behav_logp: Tensor  # behaviour policy: the engine's log-probs at generation time
    prox_logp: Tensor  # proximal policy: the learner's weights before this step's updates
    advantages: Tensor

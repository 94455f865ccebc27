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
    #: (N,) bool: a step of the trajectory was the simulated user's error (`info["user_error"]`):
    #: ERPO (`grpo_env_std`) masks these; None = no trajectory has one
    user_error: Tensor | None = None

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
    def trajectory_tokens(self) -> TrajectoryTokens:
        """Each trajectory's action tokens in order, whichever rows (one or one per step) hold them."""
        return trajectory_tokens(
            self.mask, self.token_step, self.step_index, self.row_traj, self.rewards.numel()
        )

    @property
    def step_end(self) -> Tensor:
        """(B, T) bool: the last action token of each step (where a step's reward sits)."""
        return step_ends(self.token_step)


def step_ends(token_step: Tensor) -> Tensor:
    """(B, T) bool: where a step's run of action tokens ends (the next position holds another
    step, or none): the token that carries the step's reward."""
    nxt = torch.cat([token_step[:, 1:], torch.full_like(token_step[:, :1], -1)], dim=1)
    return (token_step >= 0) & (nxt != token_step)


@dataclass(frozen=True)
class TrajectoryTokens:
    """Every action token k of a (B, T) batch sits at (row[k], col[k]) there and at
    (traj[k], pos[k]) of an (N, width) table that holds each trajectory's action tokens in order
    (its rows by their first step, each row left to right). A recursion over a trajectory (a
    return-to-go) runs over the table, so it does not restart at every row of one-row-per-step
    layouts; with one row per trajectory the table row is that row with its holes deleted."""

    row: Tensor  # (K,) long
    col: Tensor  # (K,) long
    traj: Tensor  # (K,) long
    pos: Tensor  # (K,) long
    num_traj: int
    width: int

    def to_table(self, x: Tensor) -> Tensor:
        """(B, T) -> (N, width): the action tokens' entries, 0 past each trajectory's end."""
        table = torch.zeros(self.num_traj, self.width, dtype=x.dtype, device=x.device)
        table[self.traj, self.pos] = x[self.row, self.col]
        return table

    def table_mask(self) -> Tensor:
        """(N, width) bool: True where a table entry holds an action token."""
        table = torch.zeros(self.num_traj, self.width, dtype=torch.bool, device=self.row.device)
        table[self.traj, self.pos] = True
        return table

    def to_rows(self, table: Tensor, shape: tuple[int, ...]) -> Tensor:
        """(N, width) -> (B, T) of `shape`: back onto the action tokens, 0 everywhere else."""
        out = torch.zeros(shape, dtype=table.dtype, device=table.device)
        out[self.row, self.col] = table[self.traj, self.pos]
        return out


def trajectory_tokens(
    mask: Tensor, token_step: Tensor, step_index: Tensor, row_traj: Tensor, num_traj: int
) -> TrajectoryTokens:
    """See `TrajectoryTokens`. Rows are ordered by trajectory, then by the step index of their
    first action token (rows without one last); tokens keep their order inside a row."""
    valid = mask != 0
    rows = valid.shape[0]
    # the step index of each action token (step_index padded so -1 reads past every real step)
    last = torch.iinfo(torch.long).max
    padded = torch.cat([step_index.long(), torch.tensor([last])])
    tok_index = padded[torch.where(token_step >= 0, token_step, step_index.numel())]
    # a column of `last` so that rows without action tokens (and a batch without columns) sort last
    first = torch.cat([torch.where(valid, tok_index, last), torch.full((rows, 1), last)], dim=1).amin(dim=1)
    by_step = torch.sort(first, stable=True).indices
    order = by_step[torch.sort(row_traj[by_step], stable=True).indices]
    row_pos, col = torch.nonzero(valid[order], as_tuple=True)
    row = order[row_pos]
    traj = row_traj[row]
    counts = torch.zeros(num_traj, dtype=torch.long).index_add_(0, traj, torch.ones_like(traj))
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.arange(traj.numel()) - starts[traj]
    width = int(counts.max()) if counts.numel() else 0
    return TrajectoryTokens(row, col, traj, pos, num_traj, width)


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

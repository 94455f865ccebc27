"""`mc_value`: step values regressed on Monte-Carlo returns from the group (AgentPRM-style,
arXiv 2502.10325).

A backbone copied from the policy and a scalar head (`ValueModel`) reads the state before each
step's action, V(h_t). Fitted by the squared error against the step's Monte-Carlo return, the
env's rewards from that step on (G_t = sum_{k >= t} r_k: the outcome, for an env that pays at
the end), over every step of the group's trajectories. A step's reward is the one-step
advantage of its action under that value, the Q - V that AgentPRM's step targets estimate:

    r_t = r_t(env) + V(h_{t+1}) - V(h_t),   V after the last step = 0,

which sums over a trajectory to R - V(h_0): the outcome against what the task's start was worth.
"""

from __future__ import annotations

import torch
from torch import Tensor

from steprl.training.step_rewards.base import (
    ModelContext,
    StepData,
    ValueKind,
    chunks_by_trajectory,
    rows_batch,
    step_start_positions,
)


def returns_to_go(step_rewards: Tensor, step_traj: Tensor) -> Tensor:
    """(S,) G_t = the sum of the trajectory's step rewards from t on (steps in trajectory order)."""
    out = torch.zeros_like(step_rewards)
    running: dict[int, float] = {}
    for s in range(step_rewards.numel() - 1, -1, -1):
        t = int(step_traj[s])
        running[t] = running.get(t, 0.0) + float(step_rewards[s])
        out[s] = running[t]
    return out


def next_values(values: Tensor, step_traj: Tensor) -> Tensor:
    """(S,) V of the next step of the same trajectory, 0 after its last (steps in order)."""
    nxt = torch.cat([values[1:], torch.zeros(1)])
    same = torch.cat([step_traj[1:] == step_traj[:-1], torch.zeros(1, dtype=torch.bool)])
    return torch.where(same, nxt, torch.zeros_like(nxt))


class MCValue(ValueKind):
    def __init__(self, ctx: ModelContext, *, lr: float = 1e-4, epochs: int = 1) -> None:
        if lr <= 0 or epochs < 1:
            raise ValueError(f"mc_value needs lr > 0 and epochs >= 1 (got {lr}, {epochs})")
        super().__init__(ctx, lr=lr, epochs=epochs)

    def _values(self, data: StepData, rows: list[int]) -> tuple[Tensor, Tensor]:
        """(S,) V(h_t) of the steps in these rows (others 0) as a graph, and which steps those are."""
        b, token_step = rows_batch(data, rows, self.ctx.pad_id)
        r, col, ids = step_start_positions(token_step)
        values = torch.zeros(data.num_steps).index_put((ids,), self.model.at(b, r, col), accumulate=True)
        here = torch.zeros(data.num_steps, dtype=torch.bool)
        here[ids] = True
        return values, here

    def values(self, data: StepData) -> Tensor:
        with torch.no_grad():
            total = torch.zeros(data.num_steps)
            for rows in chunks_by_trajectory(data, self.ctx.micro_batch_size):
                total += self._values(data, rows)[0]
            return total

    def score(self, data: StepData) -> Tensor:
        v, x = self.values(data), data.x
        return x.step_rewards + next_values(v, x.step_traj) - v

    def targets(self, data: StepData) -> Tensor:
        return returns_to_go(data.x.step_rewards, data.x.step_traj)

    def chunk_loss(self, data: StepData, rows: list[int], targets: Tensor) -> Tensor:
        """The squared error of these rows' V(h_t) against G_t, over all S steps."""
        v, here = self._values(data, rows)
        return ((v - targets)[here] ** 2).sum() / max(1, data.num_steps)

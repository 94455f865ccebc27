"""`progress`: a progress estimator whose per-step contributions sum to the outcome (SPA-RL,
arXiv 2505.20732), plus the grounding signal.

A backbone copied from the policy and a scalar head (`ValueModel`, zero at the start) reads the
state after each step's action and predicts its contribution c_t. Fitted on each step's
trajectories by the squared error of the sum against the outcome,

    L = mean over trajectories of (sum_t c_t - R)^2,

so nothing but the outcome supervises it: credit goes to the steps whose presence predicts
success. The step reward adds SPA-RL's grounding term, written as a penalty on an action the env
refused: r_t = c_t - grounding * [action_kind == "invalid"]. (As SPA-RL's bonus for a valid action,
+grounding * [valid], it pays every step: summed over a trajectory it grows with the length, and
a failure that runs to the turn cap outscores a short success. On gridwalk, where every action
is valid, the untrained model's tau was -0.73 and stayed negative through 12 fits; as a penalty
the two rank the same within a step and length pays nothing.)
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
    step_end_positions,
    trajectory_sums,
)


class Progress(ValueKind):
    def __init__(
        self, ctx: ModelContext, *, lr: float = 1e-3, epochs: int = 3, grounding: float = 0.1
    ) -> None:
        if lr <= 0 or epochs < 1 or grounding < 0:
            raise ValueError(
                f"progress needs lr > 0, epochs >= 1, grounding >= 0 (got {lr}, {epochs}, {grounding})"
            )
        super().__init__(ctx, lr=lr, epochs=epochs)
        self.grounding = grounding

    def _contributions(self, data: StepData, rows: list[int]) -> Tensor:
        """(S,) c_t of the steps in these rows (others 0), as a graph."""
        b, token_step = rows_batch(data, rows, self.ctx.pad_id)
        r, col, ids = step_end_positions(token_step, data.num_steps)
        return torch.zeros(data.num_steps).index_put((ids,), self.model.at(b, r, col), accumulate=True)

    def contributions(self, data: StepData) -> Tensor:
        with torch.no_grad():
            return sum(
                (
                    self._contributions(data, rows)
                    for rows in chunks_by_trajectory(data, self.ctx.micro_batch_size)
                ),
                torch.zeros(data.num_steps),
            )

    def score(self, data: StepData) -> Tensor:
        return self.contributions(data) - self.grounding * (1.0 - data.grounded())

    def targets(self, data: StepData) -> Tensor:
        return data.x.rewards

    def chunk_loss(self, data: StepData, rows: list[int], targets: Tensor) -> Tensor:
        """The squared error of each of these rows' trajectories' summed c_t against its outcome,
        over all N trajectories (the chunks' losses add up to the mean)."""
        n = targets.numel()
        trajs = sorted({data.views[i].traj_index for i in rows})
        sums = trajectory_sums(self._contributions(data, rows), data.x.step_traj, n)[trajs]
        return ((sums - targets[trajs]) ** 2).sum() / n

"""`policy_gain`: a step reward with no training, how far RL has moved the policy on the step.

    r_t = sum over the step's action tokens of log pi_theta(a|h) - log pi_ref(a|h)

pi_theta: the engine's log-probs when the tokens were sampled (the policy that acted); pi_ref:
the reference of the KL term when the run has one (`algorithm.kl_coef` > 0), else a frozen copy
of the policy as the run starts (the warm start). The "progress advantage" of arXiv 2606.26080:
the steps RL made likelier are the ones its updates credit.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from steprl.training.step_rewards.base import (
    ModelContext,
    StepData,
    chunks_by_trajectory,
    frozen_reference,
    rows_batch,
    step_sums,
    token_logprobs,
)


class PolicyGain:
    trains = False

    def __init__(self, ctx: ModelContext) -> None:
        self.ctx = ctx
        self.ref = frozen_reference(ctx)

    @torch.no_grad()
    def score(self, data: StepData) -> Tensor:
        total = torch.zeros(data.num_steps)
        for rows in chunks_by_trajectory(data, self.ctx.micro_batch_size):
            b, token_step = rows_batch(data, rows, self.ctx.pad_id)
            ref = token_logprobs(self.ref, b, self.ctx.temperature)
            total += step_sums((b.old_logp - ref) * b.loss_mask, token_step, data.num_steps)
        return total

    def fit(self, data: StepData) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}  # the reference is the run's starting policy, rebuilt as the run starts

    def load_state_dict(self, state: Any) -> None:
        pass

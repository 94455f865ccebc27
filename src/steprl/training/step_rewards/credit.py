"""The step-reward run component: a kind's model, the weight alpha it enters the advantages
with, and the drift guard that takes alpha away when the model stops agreeing with outcomes.

Each step, before the policy update (`training/loop/step_batch.make_batch`):
1. `score` the step's groups with the model as it is. Those groups are held out from it: it was
   fitted only on earlier steps' groups. The drift guard reads them: Kendall's tau between each
   trajectory's summed step reward and its outcome, over same-task pairs
   (`agreement.kendall_within_groups`). After the kind has been fitted `drift.after_fits` times
   (at once for a kind that does not train), `drift.patience` steps in a row with tau below
   `drift.min_tau` multiply alpha by `drift.decay` every step until tau recovers; alpha under 1% of
   `weight` is 0 for the rest of the run. Each cut is an ALERT line.
2. The rewards enter the estimator (`Scored.into_rewards` / `into_advantages`, by `mode`):
   * "advantage" (any estimator; iStar's A = A_episode + alpha * A_step): A_step is the step
     reward normalised over the steps of its group, (r - mean) / (std + 1e-6), broadcast onto the
     step's action tokens and added to the estimator's advantages;
   * "reward" (the estimators that read step rewards: step_gae, bi_level_gae, gae, gigpo,
     reinforce_pp): alpha * r is added to each step's reward (on its last action token too).
3. After the update (`training/loop/trainer.run_step`), every `fit_every` steps, `fit` the model on the
   same groups.

The state (the model's weights and optimizer, alpha, the fits, the guard's streak) is one
component state: a resume continues it exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from steprl.algorithms.estimators import per_step
from steprl.algorithms.inputs import AdvantageInputs, AdvantageOutput
from steprl.training.step_rewards.agreement import auroc, kendall_within_groups, positive_share_on_failures
from steprl.training.step_rewards.base import StepData, StepRewardModel, trajectory_sums


@dataclass(frozen=True)
class DriftGuard:
    min_tau: float = 0.1
    patience: int = 2
    decay: float = 0.5
    after_fits: int = 2


def group_normalised(rewards: Tensor, step_group: Tensor, eps: float = 1e-6) -> Tensor:
    """(S,) each step reward less its group's mean over steps, over its group's std (0 when flat)."""
    out = torch.zeros_like(rewards)
    for g in torch.unique(step_group):
        sel = step_group == g
        r = rewards[sel]
        std = r.std(unbiased=False) if r.numel() > 1 else torch.zeros(())
        out[sel] = (r - r.mean()) / (std + eps) if float(std) > eps else torch.zeros_like(r)
    return out


@dataclass(frozen=True)
class Scored:
    """One step's step rewards (S,), the weight they enter with, and what was measured."""

    rewards: Tensor
    alpha: float
    mode: str
    metrics: dict[str, float]
    alerts: tuple[str, ...]

    def into_rewards(self, x: AdvantageInputs) -> AdvantageInputs:
        if self.mode != "reward" or self.alpha == 0:
            return x
        added = self.alpha * self.rewards
        step_rewards = x.step_rewards + added
        ends = x.step_end
        extra = torch.where(ends, torch.cat([added, torch.zeros(1)])[x.token_step.clamp(min=0)], 0.0)
        return replace(x, step_rewards=step_rewards, token_rewards=x.token_rewards + extra)

    def into_advantages(self, x: AdvantageInputs, out: AdvantageOutput) -> AdvantageOutput:
        if self.mode != "advantage" or self.alpha == 0:
            return out
        a_step = group_normalised(self.rewards, x.group_index[x.step_traj])
        extra = per_step(x, self.alpha * a_step).advantages
        return AdvantageOutput(out.advantages + extra, out.returns)

    def per_trajectory(self, x: AdvantageInputs) -> list[list[float]]:
        """Each trajectory's step rewards, in step order (S is trajectory-major)."""
        out: list[list[float]] = [[] for _ in range(x.rewards.numel())]
        for t, r in zip(x.step_traj.tolist(), self.rewards.tolist(), strict=True):
            out[t].append(float(r))
        return out


class StepCredit:
    """See the module docstring. `kind` names the model in metrics and lines."""

    def __init__(
        self,
        kind: str,
        model: StepRewardModel,
        *,
        weight: float,
        fit_every: int,
        mode: str,
        drift: DriftGuard,
    ) -> None:
        self.kind, self.model = kind, model
        self.weight, self.fit_every, self.mode, self.drift = weight, fit_every, mode, drift
        self.alpha = weight
        self.fits = 0
        self.below = 0  # steps in a row with tau below drift.min_tau

    def score(self, data: StepData, step: int) -> Scored:
        rewards = self.model.score(data).detach().float()
        if rewards.shape != (data.num_steps,) or not bool(torch.isfinite(rewards).all()):
            raise ValueError(
                f"step reward {self.kind!r}: score must return ({data.num_steps},) finite rewards, "
                f"got {tuple(rewards.shape)}"
            )
        x = data.x
        summed = trajectory_sums(rewards, x.step_traj, x.rewards.numel())
        tau = kendall_within_groups(summed, x.rewards, x.group_index)
        alerts = self._guard(tau, step)
        metrics = {
            "step_reward/alpha": self.alpha,
            "step_reward/kendall_tau": tau,
            "step_reward/pos_share_failed": positive_share_on_failures(rewards, x.step_traj, x.rewards),
            "step_reward/mean": float(rewards.mean()) if rewards.numel() else 0.0,
            "step_reward/abs_mean": float(rewards.abs().mean()) if rewards.numel() else 0.0,
            "step_reward/fits": float(self.fits),
        }
        labels = data.step_info("step_optimal")  # an env with ground-truth step labels (gridwalk)
        if labels and all(isinstance(v, bool) for v in labels):
            metrics["step_reward/auroc"] = auroc(rewards, torch.tensor(labels))
        return Scored(rewards, self.alpha, self.mode, metrics, alerts)

    def _guard(self, tau: float, step: int) -> tuple[str, ...]:
        watching = self.fits >= self.drift.after_fits or not self.model.trains
        if not watching or math.isnan(tau) or self.alpha == 0:
            return ()
        self.below = self.below + 1 if tau < self.drift.min_tau else 0
        if self.below < self.drift.patience:
            return ()
        before = self.alpha
        self.alpha *= self.drift.decay
        if self.alpha < 0.01 * self.weight:
            self.alpha = 0.0
        gone = " for the rest of the run" if self.alpha == 0 else ""
        return (
            f"ALERT step {step}: step reward {self.kind!r} drifts from the outcomes: Kendall tau {tau:.3f} "
            f"< {self.drift.min_tau} on this step's held-out groups, {self.below} steps in a row; its "
            f"weight {before:.3g} -> {self.alpha:.3g}{gone} (algorithm.step_reward.drift)",
        )

    def fit(self, data: StepData, step: int) -> dict[str, float]:
        if not self.model.trains or step % self.fit_every:
            return {}
        metrics = self.model.fit(data)
        self.fits += 1
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "alpha": self.alpha, "fits": self.fits, "below": self.below}

    def load_state_dict(self, state: Any) -> None:
        self.model.load_state_dict(state["model"])
        self.alpha, self.fits, self.below = float(state["alpha"]), int(state["fits"]), int(state["below"])


__all__ = ["DriftGuard", "Scored", "StepCredit", "group_normalised"]

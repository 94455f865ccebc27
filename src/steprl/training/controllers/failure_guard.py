"""The failure budget at the run's scale: `runtime.max_failed_steps` steps in a row with more
than `runtime.failure_budget` of trajectories failed in the environment stop the run, naming the
backend and the last error (the envs are broken, not the policy)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from steprl.config import Config
from steprl.training.controllers.base import Adjustments, StepReport


class FailureGuard:
    reads: tuple[str, ...] = ("infra/over_budget_rounds",)

    def __init__(self, limit: int, budget: float, backend: str) -> None:
        self.limit, self.budget, self.backend = limit, budget, backend
        self.streak = 0  # consecutive steps over the failure budget

    @staticmethod
    def from_config(cfg: Config) -> FailureGuard:
        rt = cfg.runtime
        return FailureGuard(rt.max_failed_steps, rt.failure_budget, rt.backend)

    def current(self) -> Adjustments:
        return Adjustments()

    def observe(self, report: StepReport) -> Adjustments:
        over_budget = bool(report.metrics.get("infra/over_budget_rounds", 0.0))
        self.streak = self.streak + 1 if over_budget else 0
        if self.streak < self.limit:
            return Adjustments()
        errors = [str(t.info.get("error", "")) for t in report.trajectories if not t.trainable]
        last_error = next((e for e in reversed(errors) if e), "none recorded")
        return Adjustments(
            stop=f"stopped at step {report.step}: {self.streak} steps in a row had more than "
            f"{self.budget:.0%} of trajectories fail in the environment "
            f"(backend {self.backend}, runtime.max_failed_steps); last error: {last_error[:300]}"
        )

    def state_dict(self) -> dict[str, Any]:
        return {"streak": self.streak}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.streak = int(state["streak"])


__all__ = ["FailureGuard"]

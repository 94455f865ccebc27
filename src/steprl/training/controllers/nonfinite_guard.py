"""NUM-01 at the run's scale: `trainer.max_nonfinite_skips` steps in a row whose update was
skipped as non-finite (a NaN/Inf loss or gradient, `training/learn/guards.py`) stop the run."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from steprl.config import Config
from steprl.training.controllers.base import Adjustments, StepReport


class NonfiniteGuard:
    reads: tuple[str, ...] = ("actor/nonfinite_skips", "critic/nonfinite_skips")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.streak = 0  # consecutive steps with a skipped (non-finite) optimizer step

    @staticmethod
    def from_config(cfg: Config) -> NonfiniteGuard:
        return NonfiniteGuard(cfg.trainer.max_nonfinite_skips)

    def current(self) -> Adjustments:
        return Adjustments()

    def observe(self, report: StepReport) -> Adjustments:
        m = report.metrics
        skipped = m.get("actor/nonfinite_skips", 0.0) + m.get("critic/nonfinite_skips", 0.0)
        self.streak = self.streak + 1 if skipped else 0
        if self.streak < self.limit:
            return Adjustments()
        return Adjustments(
            stop=f"stopped at step {report.step}: {self.streak} steps in a row had a NaN/Inf loss or "
            "gradient, so their updates were skipped (trainer.max_nonfinite_skips); lower trainer.lr, "
            "check the rewards, or raise trainer.grad_clip"
        )

    def state_dict(self) -> dict[str, Any]:
        return {"streak": self.streak}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.streak = int(state["streak"])


__all__ = ["NonfiniteGuard"]

"""A horizon curriculum gated on performance (none of the surveyed frameworks has one): the turn
cap moves to the next of `trainer.curriculum.rounds` once, for `patience` steps in a row, the
success at the current cap is at least `success_at_least` and the share of episodes the cap cut
off is at most `cut_at_most`; otherwise it holds. Used when `trainer.curriculum.horizon` is
`gated`.

It reads `curriculum/*` (`training/loop/pipeline.py: horizon_metrics`), measured only over the episodes
that ran under the current cap: in asynchronous training a stale group ran under an older one
and says nothing about this one. A step with no such episode (or that trained nothing) leaves
the streak as it was."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from steprl.config import Config
from steprl.training.controllers.base import Adjustments, StepReport


class HorizonGated:
    reads: tuple[str, ...] = (
        "curriculum/success_at_cap",
        "curriculum/cut_by_cap_frac",
        "curriculum/episodes_at_cap",
    )

    def __init__(
        self, rounds: Sequence[int], success_at_least: float, cut_at_most: float, patience: int
    ) -> None:
        self.rounds = tuple(rounds)
        self.success_at_least, self.cut_at_most, self.patience = success_at_least, cut_at_most, patience
        self.stage = 0
        self.streak = 0  # steps in a row that met both thresholds at the current cap

    @staticmethod
    def from_config(cfg: Config) -> HorizonGated:
        cur = cfg.trainer.curriculum
        assert cur is not None  # `used` checks it
        return HorizonGated(cur.rounds, cur.success_at_least, cur.cut_at_most, cur.patience)

    def current(self) -> Adjustments:
        return Adjustments(max_turns=self.rounds[self.stage])

    def observe(self, report: StepReport) -> Adjustments:
        m = report.metrics
        if report.hold_curriculum:  # a health rule holds it: no evidence counted
            return self.current()
        if not m.get("curriculum/episodes_at_cap", 0.0) or self.stage == len(self.rounds) - 1:
            return self.current()  # no evidence at this cap, or nowhere further to go
        ready = (
            m.get("curriculum/success_at_cap", 0.0) >= self.success_at_least
            and m.get("curriculum/cut_by_cap_frac", 1.0) <= self.cut_at_most
        )
        self.streak = self.streak + 1 if ready else 0
        if self.streak >= self.patience:
            self.stage, self.streak = self.stage + 1, 0
        return self.current()

    def state_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "streak": self.streak}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.stage, self.streak = int(state["stage"]), int(state["streak"])


__all__ = ["HorizonGated"]

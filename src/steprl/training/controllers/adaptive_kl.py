"""The adaptive reward-KL coefficient (Ziegler et al. 2019; verl `AdaptiveKLController`): after
each step the coefficient moves toward the target KL. Used when `algorithm.kl_ctrl=adaptive`
(which the config allows only with the KL in the reward)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from steprl.algorithms.losses import AdaptiveKLController
from steprl.config import Config
from steprl.training.controllers.base import Adjustments, StepReport


class AdaptiveKL:
    reads: tuple[str, ...] = ("actor/reward_kl", "actor/reward_kl_rows")

    def __init__(self, beta: float, target: float, horizon: int) -> None:
        self._ctl = AdaptiveKLController(beta, target, horizon)

    @staticmethod
    def from_config(cfg: Config) -> AdaptiveKL:
        algo = cfg.algorithm
        return AdaptiveKL(algo.kl_coef, algo.kl_target, algo.kl_horizon)

    def current(self) -> Adjustments:
        return Adjustments(kl_coef=self._ctl.beta)

    def observe(self, report: StepReport) -> Adjustments:
        m = report.metrics
        if "actor/reward_kl" in m:  # a step that trained nothing measured no KL: it stays
            # verl: n_steps = the rows of the batch, before the LOOP filter
            self._ctl = self._ctl.update(m["actor/reward_kl"], int(m["actor/reward_kl_rows"]))
        return self.current()

    def state_dict(self) -> dict[str, Any]:
        return {"beta": self._ctl.beta}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._ctl = AdaptiveKLController(float(state["beta"]), self._ctl.target, self._ctl.horizon)


__all__ = ["AdaptiveKL"]
